"""Linear: nn.Linear with a second way to multiply a few tokens on the CPU, and the measurement
that chooses between the two ways on the CPU at hand (Transformer.from_pretrained runs it)."""
import math
import time

import torch
import torch.nn as nn


class Linear(nn.Linear):
    """nn.Linear, except that on the CPU the token counts in `transposed` multiply as (W @ x^T)^T.

    Decoding multiplies a few tokens by large weights, and MKL runs x @ W^T (F.linear) and
    W @ x^T through different kernels: as sgemm's small operand the weights are packed (read,
    written, read again) on every call, as the large one streamed once. Which is faster depends
    on the CPU and the token count (a 2-core AVX2 EPYC, SmolLM2's layers: 1 token 34 ms against
    62, 4 tokens 35 against 97), so tune_cpu_products measures it rather than assume it. A single
    token goes as two columns (a copy, dropped after): MKL's one-column kernel is a third path,
    slower on that CPU."""

    transposed = frozenset()  # token counts multiplied as (W @ x^T)^T; F.linear for the rest

    def forward(self, x):
        # The device and compiling first: under torch.compile a test of the token count would
        # guard it, one graph for every count (CompiledStep wants one for all), and inductor
        # picks its own kernels there anyway.
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return super().forward(x)
        n = x.numel() // x.shape[-1]
        if n not in self.transposed:
            return super().forward(x)
        x2 = x.reshape(-1, x.shape[-1])  # (B*T, in)
        if n == 1:
            x2 = torch.cat((x2, x2))  # (2, in)
        y = torch.mm(self.weight, x2.t())[:, :n]  # (out, B*T)
        # Copied to (B*T, out) as a 3-D tensor: a 2-D transposed copy of 3,600 values or more
        # takes torch's blocked transpose, slow for a matrix this thin (docs/PERFORMANCE.md).
        y = y.t().unsqueeze(0).contiguous()  # (1, B*T, out)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


@torch.inference_mode()
def tune_cpu_products(linears: list[Linear], sizes, most: int, sample_bytes: int = 64 << 20) -> frozenset:
    """Time both ways of multiplying n tokens for each n in `sizes` on these layers' own weights,
    and set every layer's `transposed` to the counts 1..most where (W @ x^T)^T was faster (a
    count takes the result of the next measured size up; past the largest, of the largest).
    Counts past `most` (a long prefill) keep F.linear: there packing pays for itself (2,000
    tokens: 1.2x faster on the EPYC above). Timed: the products of the first layers, at least
    sample_bytes of weights so that they stream from memory as in a forward instead of sitting
    in a cache; the two ways alternate and each keeps its best of two (SmolLM2-135M: about
    0.2 s). Returns the counts chosen."""
    sample, size = [], 0
    while len(sample) < len(linears) and size < sample_bytes:
        sample.append(linears[len(sample)])
        size += sample[-1].weight.nbytes

    def seconds(n, transposed):
        xs = {m.in_features: torch.randn(n, m.in_features, dtype=m.weight.dtype) for m in sample}
        for m in sample:
            m.transposed = frozenset({n} if transposed else ())
        start = time.perf_counter()
        for m in sample:
            m(xs[m.in_features])
        return time.perf_counter() - start

    faster = set()
    for n in sizes:
        best = {False: math.inf, True: math.inf}
        for _ in range(2):
            for transposed in best:
                best[transposed] = min(best[transposed], seconds(n, transposed))
        if best[True] < best[False]:
            faster.add(n)
    chosen = frozenset(n for n in range(1, most + 1) if next((s for s in sizes if s >= n), sizes[-1]) in faster)
    for m in linears:
        m.transposed = chosen
    return chosen
