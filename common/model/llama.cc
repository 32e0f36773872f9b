#include "common/model/llama.h"
