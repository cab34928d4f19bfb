// c includes a, through its public header: a circle a -> b -> c -> a.
#include "scaletrain/alpha.h"
