"""Whether this CPU's AVX2 FMAs take float32 denormal inputs at full speed.

cpu_dot.h's FT_F8L_SHIFT decodes an e4m3 weight to float32 at 2^-120 of its value, so an e4m3
subnormal (~1e-4 of a checkpoint's weights, |w| under 2^-6 of a 448 full scale) meets the FMA
as a float32 denormal, while x carries 2^64 and every product is normal. It is compiled where
the target is an AMD Zen core, measured here to take those at full speed; Intel's AVX2 cores
keep the byte tables, since some of their FP operations take a microcode assist on a denormal
operand. This times 8 FMA chains over weights that are all normal, one vector in 64 holding a
denormal (a checkpoint's rate and more), and all denormal, against normal x scaled as the
kernel scales it: a ratio near 1 says the shift decode would run at its speed on this CPU.

    python bench/fma_denormals.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ns an FMA over n weights (8 chains), of which one vector in `every` holds denormals */
static double run(int every) {
    const int n = 1 << 12, reps = 20000;
    float *w = aligned_alloc(32, n * 4), *x = aligned_alloc(32, n * 4);
    for (int i = 0; i < n; i++) {
        /* 0x3f800000: 1.0 at 2^-120 is 0x03800000; 0x00300000: a denormal, as an e4m3
         * subnormal decodes */
        uint32_t b = every && (i / 8) % every == 0 ? 0x00300000u : 0x03800000u;
        memcpy(&w[i], &b, 4);
        x[i] = 0x1p64f;                 /* x's unit in the kernel: products are normal */
    }
    __m256 acc[8];
    for (int k = 0; k < 8; k++)
        acc[k] = _mm256_setzero_ps();
    double t = now();
    for (int it = 0; it < reps; it++)
        for (int i = 0; i < n; i += 64)
            for (int k = 0; k < 8; k++)
                acc[k] = _mm256_fmadd_ps(_mm256_load_ps(w + i + 8 * k),
                                         _mm256_load_ps(x + i + 8 * k), acc[k]);
    t = now() - t;
    float s[8];
    _mm256_storeu_ps(s, acc[0]);
    if (s[0] < 0)                       /* keep the sums alive */
        printf("?");
    free(w), free(x);
    return t * 1e9 / ((double)reps * n / 8);
}

int main(void) {
    const double normal = run(0), some = run(64), all = run(1);
    printf("ns an FMA: normal %.3f, 1 vector in 64 denormal %.3f (%.2fx), all denormal %.3f "
           "(%.2fx)\n", normal, some, some / normal, all, all / normal);
    return 0;
}
"""


def main() -> int:
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma")
        with open(src, "w") as f:
            f.write(SOURCE)
        built = subprocess.run([cc, "-O2", "-mavx2", "-mfma", src, "-o", exe],
                               capture_output=True, text=True)
        if built.returncode:
            print(f"{cc} failed: {built.stderr.strip()}", file=sys.stderr)
            return 1
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("model name")), "unknown CPU")
        print(model)
        return subprocess.run([exe]).returncode


if __name__ == "__main__":
    sys.exit(main())
