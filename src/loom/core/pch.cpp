// Anchor TU for the shared precompiled header.
#include "loom/core/pch.h"
