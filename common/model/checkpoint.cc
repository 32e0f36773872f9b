#include "common/model/checkpoint.h"
