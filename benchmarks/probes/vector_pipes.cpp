// Probe: which zmm instructions share the CPU's pipes with the attention's integer products
// (vpdpwssd). Each line times a loop of 8 independent vpdpwssd, or 8 of another instruction, or
// both, in cycles a loop at the clock given: where both together take the sum of their times
// alone they compete for the same pipes; where they take the longer one they run side by side.
// Written in inline assembly so the compiler cannot spill, fold or reorder the chains.
// Result on a Zen 4 (docs/benchmarks-journal.md "The value products fold in their registers"):
// vpdpwssd, vfmadd, vmulps one a cycle each and competing (8 + 8 -> 16 cycles); vaddps, vmaxps,
// vcvtdq2ps beside them for free; vscalefps one every two cycles, on the products' pipes.
//
// From the repository root: g++ -O2 -o /tmp/vector_pipes benchmarks/probes/vector_pipes.cpp &&
//   /tmp/vector_pipes 3.66   (the clock in GHz: measure it, a chain of dependent 1-cycle adds)
#include <chrono>
#include <cstdio>
#include <cstdlib>

using clk = std::chrono::steady_clock;

#define V8                                                                                                \
  "vpdpwssd %%zmm30, %%zmm31, %%zmm0\n vpdpwssd %%zmm30, %%zmm31, %%zmm1\n vpdpwssd %%zmm30, %%zmm31, "   \
  "%%zmm2\n vpdpwssd %%zmm30, %%zmm31, %%zmm3\n vpdpwssd %%zmm30, %%zmm31, %%zmm4\n vpdpwssd %%zmm30, " \
  "%%zmm31, %%zmm5\n vpdpwssd %%zmm30, %%zmm31, %%zmm6\n vpdpwssd %%zmm30, %%zmm31, %%zmm7\n"
#define F8(op)                                                                                          \
  op " %%zmm30, %%zmm31, %%zmm8\n " op " %%zmm30, %%zmm31, %%zmm9\n " op " %%zmm30, %%zmm31, %%zmm10\n " op \
     " %%zmm30, %%zmm31, %%zmm11\n " op " %%zmm30, %%zmm31, %%zmm12\n " op " %%zmm30, %%zmm31, %%zmm13\n " op \
     " %%zmm30, %%zmm31, %%zmm14\n " op " %%zmm30, %%zmm31, %%zmm15\n"
#define U8(op)                                                                                              \
  op " %%zmm30, %%zmm8\n " op " %%zmm30, %%zmm9\n " op " %%zmm30, %%zmm10\n " op " %%zmm30, %%zmm11\n " op \
     " %%zmm30, %%zmm12\n " op " %%zmm30, %%zmm13\n " op " %%zmm30, %%zmm14\n " op " %%zmm30, %%zmm15\n"
#define RUN(name, body)                                                                                     \
  {                                                                                                         \
    const long n = 20000000;                                                                                \
    const auto t = clk::now();                                                                              \
    asm volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n vpxord %%zmm31, %%zmm31, %%zmm31\n mov %0, %%rcx\n 1:\n" body \
                 "dec %%rcx\n jnz 1b\n"                                                                     \
                 :                                                                                          \
                 : "r"(n)                                                                                   \
                 : "rcx", "memory");                                                                        \
    const double s = std::chrono::duration<double>(clk::now() - t).count();                                 \
    std::printf("%-26s %.2f cycles a loop\n", name, s * ghz * 1e9 / n);                                     \
  }

int main(int argc, char** argv) {
  const double ghz = argc > 1 ? std::atof(argv[1]) : 3.0;
  RUN("8 vpdpwssd", V8)
  RUN("8 vfmadd231ps", F8("vfmadd231ps"))
  RUN("8 vpdpwssd + 8 vfmadd", V8 F8("vfmadd231ps"))
  RUN("8 vmulps", F8("vmulps"))
  RUN("8 vpdpwssd + 8 vmulps", V8 F8("vmulps"))
  RUN("8 vaddps", F8("vaddps"))
  RUN("8 vpdpwssd + 8 vaddps", V8 F8("vaddps"))
  RUN("8 vmaxps", F8("vmaxps"))
  RUN("8 vpdpwssd + 8 vmaxps", V8 F8("vmaxps"))
  RUN("8 vscalefps", F8("vscalefps"))
  RUN("8 vpdpwssd + 8 vscalefps", V8 F8("vscalefps"))
  RUN("8 vcvtdq2ps", U8("vcvtdq2ps"))
  RUN("8 vpdpwssd + 8 vcvtdq2ps", V8 U8("vcvtdq2ps"))
  RUN("8 vpaddd", F8("vpaddd"))
  RUN("8 vpdpwssd + 8 vpaddd", V8 F8("vpaddd"))
  return 0;
}
