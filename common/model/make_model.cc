#include "common/model/make_model.h"
