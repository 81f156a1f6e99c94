// AMX tiles (Sapphire Rapids and later Xeons), where the build has them (simd.h's BRINE_SIMD_AMX): the process's
// grant, and a thread's tile shapes. The quantized linears (quant_linear.cpp) and the bfloat16 attention
// (paged_attention.cpp) take their bfloat16 dot products on tiles where `on()`, for every call alike: a tile
// product's C element is its own chain over its row and column, so a row's bits depend on nothing but itself,
// but they are tdpbf16ps' own (it sums the even and the odd pairs apart, then adds them), not vdpbf16ps'.
#pragma once

#include <cstdint>

#include "simd.h"

#if defined(BRINE_SIMD_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace brine::amx {

// A thread's tile shapes (palette 1): rows and bytes per row of each of the 8 tiles.
struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    void shape(int tile, int r, int bytes) {
        rows[tile] = static_cast<uint8_t>(r);
        colsb[tile] = static_cast<uint16_t>(bytes);
    }
};

#if defined(BRINE_SIMD_AMX)
// Linux gives a process AMX's tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, Linux 5.16+); a tile instruction without it is a SIGILL. Asked once per process.
inline bool on() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
}

// Loads `config` into this thread's tiles (null: none) and releases them at the end of the scope: oneDNN's AMX
// kernels run on the same OpenMP threads with their own shapes, so every call loads its own.
class Scope {
   public:
    explicit Scope(const Config* config) : on_(config != nullptr) {
        if (on_) _tile_loadconfig(config);
    }
    ~Scope() {
        if (on_) _tile_release();
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    bool on_;
};
#else
inline bool on() { return false; }
class Scope {
   public:
    explicit Scope(const Config*) {}
};
#endif

}  // namespace brine::amx
