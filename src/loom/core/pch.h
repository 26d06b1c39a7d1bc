// Precompiled header shared by every Loom target: the heavy, stable headers only.
#pragma once
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>
