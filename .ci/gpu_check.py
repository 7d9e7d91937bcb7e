"""The GPU check, run by .ci/gpu: what this project has never measured, most valuable first, each
part guarded and capped in time, every result appended to $OUT/gpu.md as it comes.

  (a) exactness: random tiny models of every family, float32 (and bfloat16 / float16 where the
      device has them), eager and compiled: lookahead (fixed and dynamic) against greedy; on a
      mismatch the first differing index and greedy's top-2 logit gap there; host syncs a step.
  (b) the step-cost curve: ~1B and ~8B Llama shapes with random weights made on the device,
      seconds a step for sizes 1, 2, 4, ... 256 at 1k and 4k committed tokens, eager and compiled;
      a table, and a file per curve under $OUT/costs that `bench.py --costs FILE` reads.
  (c) the real SmolLM2 where it travelled (MODEL, see models/README.md); one line where not.

It needs only torch, the repository and (for (c)) tokenizers and jinja2. DEVICE=cpu runs the
same parts on tiny shapes (the dry form .ci/run runs, so that it cannot rot unseen).
"""
import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

DEV = torch.device(os.environ.get("DEVICE", "cuda"))
DRY = DEV.type == "cpu"
OUT = Path(os.environ.get("OUT") or "/tmp/gpu-check")
OUT.mkdir(parents=True, exist_ok=True)
REPORT = OUT / "gpu.md"
STARTED = time.time()
FAILED = []  # the parts that raised: the exit status says so (.ci/run's dry form fails on one)


def report(line=""):
    """Print a line and append it to gpu.md at once: a run killed at its limit keeps what it had."""
    print(line, flush=True)
    with open(REPORT, "a") as f:
        f.write(line + "\n")


class PartTimeout(Exception):
    pass


def part(name, cap, fn):
    """Run one part under a time cap (SIGALRM), its traceback in the log on any error."""
    report(f"\n## {name} (started {time.strftime('%H:%M:%S')}, +{time.time() - STARTED:.0f} s, cap {cap} s)\n")

    def expire(*_):
        raise PartTimeout(f"over its cap of {cap} s")
    signal.signal(signal.SIGALRM, expire)
    signal.alarm(cap)
    start = time.perf_counter()
    try:
        fn()
    except Exception as e:  # report and go on to the next part
        FAILED.append(name)
        report(f"- FAILED: {type(e).__name__}: {e}")
        for line in traceback.format_exc().rstrip().splitlines():
            report(f"    {line}")
    finally:
        signal.alarm(0)
    report(f"\n[{name}: {time.perf_counter() - start:.0f} s]")


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def counted_syncs(fn):
    """fn()'s result and how many synchronising CUDA calls it made (None off CUDA)."""
    if DEV.type != "cuda":
        return fn(), None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in caught)


def dtypes():
    out = [torch.float32]
    if DEV.type == "cuda":
        out.append(torch.float16)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            out.append(torch.bfloat16)
    return out


# --- (a) exactness ---------------------------------------------------------------------------

def first_difference(model, prompt, want, got):
    """'index i, greedy's top-2 gap g' for the first token where two outputs differ."""
    i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:i]], device=DEV))[0, -1].float()
    top = logits.topk(2).values
    return f"first difference at token {i}, greedy's top-2 logit gap there {float(top[0] - top[1]):.2e}"


def exactness():
    from conftest import FAMILY_OPTIONS, random_model
    from decoding import greedy_decode
    from engine import generate
    report("| family | dtype | step | fixed 2,3,2 | dynamic | host syncs a step: greedy, lookahead |")
    report("|---|---|---|---|---|---|")
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3]
    for family, options in FAMILY_OPTIONS.items():
        for dtype in dtypes():
            for compiled in (False, True) if family == "llama" and dtype == torch.float32 else (False,):
                model = random_model(3, dtype=dtype, vocab_size=32, **options).to(DEV)
                if compiled:
                    model.compile_steps((1, 16), 128)
                want, g_syncs = counted_syncs(lambda: greedy_decode(model, prompt, 40))
                cells = []
                for options_ in (dict(window=2, ngram=3, candidates=2), {}):
                    got, syncs = counted_syncs(lambda: generate(model, prompt, 40, **options_))
                    same = got.tokens == want.tokens
                    cells.append("identical" if same else f"DIFFERS: {first_difference(model, prompt, want.tokens, got.tokens)}")
                    if not options_:
                        l_syncs = None if syncs is None else syncs / max(got.steps, 1)
                report(f"| {family} | {str(dtype)[6:]} | {'compiled' if compiled else 'eager'} | {cells[0]} | {cells[1]} | "
                       f"{'-' if g_syncs is None else f'{g_syncs / max(want.steps, 1):.2f}'}, "
                       f"{'-' if l_syncs is None else f'{l_syncs:.2f}'} |")


# --- (b) the step-cost curve -----------------------------------------------------------------

SHAPES = {  # Llama 3.2 1B and Llama 3.1 8B; tiny stand-ins for the dry form
    "llama-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, hidden_dim=8192, vocab_size=128256),
    "llama-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336, vocab_size=128256),
}
DRY_SHAPES = {"tiny-a": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=256),
              "tiny-b": dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16, hidden_dim=192, vocab_size=256)}
SIZES = (1, 2, 4, 8, 16) if DRY else (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (64, 128) if DRY else (1024, 4096)


def random_llama(shape: dict, dtype):
    """A Llama of this shape with random weights made on the device (no checkpoint to carry)."""
    from model import ModelArgs, Rope, Transformer
    args = ModelArgs(**shape, max_seq_len=max(CONTEXTS) + 2 * max(SIZES) + 1, rope_theta=500000.0)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=DEV).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.rope = Rope(args).to(DEV)  # its frequencies computed (float32), not left empty
    return model.eval().requires_grad_(False)


def step_seconds(model, T: int, committed: int, repeats: int) -> float:
    """Seconds of one step of T tokens after `committed` (mean of `repeats`, after 3 warm-ups)."""
    idx = torch.arange(T, device=DEV)[None]
    C = torch.full((1, 1), committed, device=DEV)
    mask = torch.ones(1, T, T, dtype=torch.bool, device=DEV).tril()
    read = torch.arange(T, device=DEV)[None]
    run = lambda: model.step(idx % 100, C + idx, C, mask, (committed, committed), read)
    for _ in range(3):
        run()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    sync()
    return (time.perf_counter() - start) / repeats


COMPILED_SIZES = (1, 4) if DRY else (1, 4, 16, 64, 128, 256)  # each size a compile: the menu's landmarks


def curves(names, compiled: bool):
    dtype = torch.float32 if DRY else torch.bfloat16
    shapes = DRY_SHAPES if DRY else SHAPES
    sizes = COMPILED_SIZES if compiled else SIZES
    for name in names:
        shape = shapes[name]
        model = random_llama(shape, dtype)
        mode = "compiled" if compiled else "eager"
        if compiled:
            start = time.perf_counter()
            model.compile_steps(sizes, max(CONTEXTS) + max(sizes))
            report(f"- {name}: compiled {len(sizes)} sizes in {time.perf_counter() - start:.0f} s")
        else:
            model.cache.setup(max(CONTEXTS) + max(sizes))
        with torch.inference_mode():
            for context in CONTEXTS:
                seconds = {T: step_seconds(model, T, context, 3 if DRY else 10) for T in sizes}
                label = f"{name}-{str(dtype)[6:]}-{mode}-{context}"
                (OUT / "costs").mkdir(exist_ok=True)
                (OUT / "costs" / f"{label}.json").write_text(json.dumps(dict(
                    model=name, shape=shape, dtype=str(dtype), mode=mode, context=context, device=device_name(),
                    seconds={str(T): t for T, t in seconds.items()}), indent=1))
                report(f"| {name} | {mode} | {context} | " + " | ".join(
                    f"{1e3 * seconds[T]:.2f} ({seconds[T] / seconds[1]:.2f}x)" if T in seconds else "-"
                    for T in SIZES) + " |")
        del model
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


def curve_header():
    report("ms a step (x a 1-token step); the files under costs/ hold the seconds (bench.py --costs FILE)\n")
    report("| model | step | committed | " + " | ".join(f"{T} tokens" for T in SIZES) + " |")
    report("|---|---|---|" + "---|" * len(SIZES))


def device_name():
    return torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "cpu"


# --- (c) the real SmolLM2 --------------------------------------------------------------------

def smollm2():
    folder = os.environ.get("MODEL", "")
    if not folder or not (Path(folder) / "config.json").exists():
        report(f"- SmolLM2 did not travel to this machine (MODEL={folder or 'unset'}): part (c) not run")
        return
    from decoding import greedy_decode
    from engine import generate
    from model import Transformer
    from tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(folder)
    model = Transformer.from_pretrained(folder, DEV, torch.float32)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in (
        "Count from 1 to 30, separated by commas.", "Explain what a hash table is in three sentences.",
        "Write a Python function that checks whether a number is prime.")]
    n = 16 if DRY else 64
    runs = [("greedy", lambda ids: greedy_decode(model, ids, n, tok.stop_ids)),
            ("7,5,7", lambda ids: generate(model, ids, n, window=7, ngram=5, candidates=7, stop_ids=tok.stop_ids)),
            ("dynamic", lambda ids: generate(model, ids, n, stop_ids=tok.stop_ids))]
    for _, run in runs:
        run(prompts[0])  # warm-up
    report("| SmolLM2, float32, eager | tokens/s | tokens/step | host ms/step | host syncs/step | same as greedy |")
    report("|---|---|---|---|---|---|")
    base = []
    for name, run in runs:
        gens, syncs = zip(*(counted_syncs(lambda: run(ids)) for ids in prompts))
        base = base or [g.tokens for g in gens]
        steps = sum(g.steps for g in gens)
        report(f"| {name} | {sum(len(g.tokens) for g in gens) / sum(g.seconds for g in gens):.1f} | "
               f"{sum(sum(g.committed) for g in gens) / steps:.2f} | "
               f"{1e3 * sum(g.host_seconds for g in gens) / steps:.2f} | "
               f"{'-' if syncs[0] is None else f'{sum(syncs) / steps:.2f}'} | "
               f"{'yes' if [g.tokens for g in gens] == base else 'NO'} |")


if __name__ == "__main__":
    report(f"# GPU check: {device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}"
           + (" (dry form: tiny shapes)" if DRY else ""))
    small, large = DRY_SHAPES if DRY else SHAPES
    part("(a) exactness: tiny models of every family", 60 if DRY else 90, exactness)
    part("(b) the step-cost curve, eager", 30 if DRY else 60, lambda: (curve_header(), curves((small, large), False)))
    part(f"(b) the step-cost curve, compiled, {small}", 60 if DRY else 130, lambda: (curve_header(), curves((small,), True)))
    if not DRY:  # on a CPU one compiled curve shows the part works; each costs a compile a size
        part(f"(b) the step-cost curve, compiled, {large}", 130, lambda: (curve_header(), curves((large,), True)))
    part("(c) the real SmolLM2", 40 if DRY else 50, smollm2)
    report(f"\n[all parts: {time.time() - STARTED:.0f} s{'; FAILED: ' + ', '.join(FAILED) if FAILED else ''}]")
    sys.exit(1 if FAILED else 0)
