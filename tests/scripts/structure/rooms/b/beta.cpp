// b includes c.
#include "c/gamma.h"
