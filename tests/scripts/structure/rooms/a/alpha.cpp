// A room of a made-up library that includes b.
#include "b/beta.h"
