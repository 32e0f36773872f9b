#include "common/model/tokenizer.h"
