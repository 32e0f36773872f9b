#include "common/model/safetensors.h"
