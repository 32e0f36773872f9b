#include "common/model/config.h"
