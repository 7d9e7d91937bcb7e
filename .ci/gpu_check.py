"""The GPU check, run by .ci/gpu: what this project has never measured, most valuable first. Each
part runs in a process of its own under a hard time cap (killed with its children when the cap
runs out), and appends its results to $OUT/gpu.md as they come, so a part cut short keeps what it
had and the next part still runs.

  (a) exactness: random tiny models of every family, float32 (and bfloat16 / float16 where the
      device has them), eager and compiled: lookahead (fixed and dynamic) against greedy, each
      row on its own (one that raises says so and the rest go on); on a mismatch the first
      differing index and greedy's top-2 logit gap there; host syncs a step.
  (b) the step-cost curve: ~1B and ~8B Llama shapes with random weights made on the device,
      seconds a step for sizes 1, 2, 4, ... 256 at 1k and 4k committed tokens, eager, then
      compiled a size at a time (each size measured as soon as it is compiled); every curve in
      $OUT/curves.json, which `bench.py --costs curves.json:LABEL` reads.
  (c) the real SmolLM2 where it travelled (MODEL, see models/README.md), eager, then compiled
      as `--compile` loads it; one line where it did not travel.

It needs only torch, the repository and (for (c)) tokenizers and jinja2. DEVICE=cpu runs the
same parts on tiny shapes (the dry form .ci/run runs, so that it cannot rot unseen). Exit status:
1 where a part raised or a float32 answer differed from greedy's; a cap that runs out is
reported, and fails nothing (a slow or busy machine is not a broken one).
"""
import json
import os
import signal
import subprocess
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
REPORT, CURVES = OUT / "gpu.md", OUT / "curves.json"
WRONG = 3  # a part's exit status where an answer that must equal greedy's did not


def report(line=""):
    """Print a line and append it to gpu.md at once: a part killed at its cap keeps what it had."""
    print(line, flush=True)
    with open(REPORT, "a") as f:
        f.write(line + "\n")


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


def device_name():
    return torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "cpu"


def cudagraph_skips() -> str:
    """Inductor's count of compiled graphs run without a CUDA graph (notes: each is a lost replay)."""
    from torch._dynamo.utils import counters
    return "-" if DEV.type != "cuda" else str(counters["inductor"]["cudagraph_skips"])


# --- (a) exactness ---------------------------------------------------------------------------

def first_difference(model, prompt, want, got):
    """'index i, greedy's top-2 gap g' for the first token where two outputs differ."""
    i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:i]], device=DEV))[0, -1].float()
    top = logits.topk(2).values
    return f"first difference at token {i}, greedy's top-2 logit gap there {float(top[0] - top[1]):.2e}"


def exactness() -> bool:
    from conftest import FAMILY_OPTIONS, random_model
    from decoding import greedy_decode
    from engine import generate
    report("| family | dtype | step | fixed 2,3,2 | dynamic | host syncs a step: greedy, lookahead |")
    report("|---|---|---|---|---|---|")
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3]
    exact = True
    for family, options in FAMILY_OPTIONS.items():
        for dtype in dtypes():
            for compiled in (False, True) if family == "llama" and dtype == torch.float32 else (False,):
                row = f"| {family} | {str(dtype)[6:]} | {'compiled' if compiled else 'eager'} |"
                try:  # each row on its own: one that raises loses itself, not the rest
                    model = random_model(3, dtype=dtype, vocab_size=32, **options).to(DEV)
                    if compiled:
                        model.compile_steps((1, 16), 128)
                    want, g_syncs = counted_syncs(lambda: greedy_decode(model, prompt, 40))
                    cells, l_syncs = [], None
                    for options_ in (dict(window=2, ngram=3, candidates=2), {}):
                        got, syncs = counted_syncs(lambda: generate(model, prompt, 40, **options_))
                        same = got.tokens == want.tokens
                        exact &= same or dtype != torch.float32  # half precision may round a near-tie apart
                        cells.append("identical" if same else f"DIFFERS: {first_difference(model, prompt, want.tokens, got.tokens)}")
                        if not options_ and syncs is not None:
                            l_syncs = syncs / max(got.steps, 1)
                    report(f"{row} {cells[0]} | {cells[1]} | "
                           f"{'-' if g_syncs is None else f'{g_syncs / max(want.steps, 1):.2f}'}, "
                           f"{'-' if l_syncs is None else f'{l_syncs:.2f}'} |")
                except Exception as e:
                    exact = False
                    report(f"{row} FAILED: {type(e).__name__}: {str(e)[:200]} | | |")
                    traceback.print_exc()
    return exact


# --- (b) the step-cost curve -----------------------------------------------------------------

SHAPES = {  # Llama 3.2 1B and Llama 3.1 8B; tiny stand-ins for the dry form
    "llama-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, hidden_dim=8192, vocab_size=128256),
    "llama-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336, vocab_size=128256),
}
DRY_SHAPES = {"tiny-a": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=256),
              "tiny-b": dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16, hidden_dim=192, vocab_size=256)}
SMALL, LARGE = DRY_SHAPES if DRY else SHAPES
SIZES = (1, 2, 4, 8, 16) if DRY else (1, 2, 4, 8, 16, 32, 64, 128, 256)
COMPILED_SIZES = (1, 4) if DRY else (1, 4, 16, 64, 128, 256)  # the menu's landmarks
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


def save_curve(label: str, **curve):
    """Add one curve to curves.json (written whole, then renamed: never half a file)."""
    curves = json.loads(CURVES.read_text()) if CURVES.exists() else {}
    curves[label] = curve
    tmp = CURVES.with_suffix(".tmp")
    tmp.write_text(json.dumps(curves, indent=1))
    tmp.replace(CURVES)


def curve(name: str, compiled: bool):
    """One model's curve: a row a size (ms at each context, and x that context's 1-token step),
    written as soon as the size is measured; compiled, each size is compiled just before. The
    curves go to curves.json as LABEL: {"seconds": {"1": s, ...}, ...}."""
    dtype = torch.float32 if DRY else torch.bfloat16
    shape = (DRY_SHAPES if DRY else SHAPES)[name]
    sizes, mode = (COMPILED_SIZES, "compiled") if compiled else (SIZES, "eager")
    start = time.perf_counter()
    model = random_llama(shape, dtype)
    if compiled:
        model.compile_steps((), max(CONTEXTS) + max(sizes))  # the cache; sizes added one by one below
    else:
        model.cache.setup(max(CONTEXTS) + max(sizes))
    report(f"{name}, {str(dtype)[6:]}, {mode}: made on the device in {time.perf_counter() - start:.0f} s; "
           "ms a step (x a 1-token step at that context)\n")
    report("| model | step | size | " + " | ".join(f"{c} committed" for c in CONTEXTS) + " | compile (s) |")
    report("|---|---|---|" + "---|" * len(CONTEXTS) + "---|")
    seconds = {c: {} for c in CONTEXTS}
    with torch.inference_mode():
        for T in sizes:
            compile_seconds = "-"
            if compiled:
                start = time.perf_counter()
                model.compiled.add(T)
                compile_seconds = f"{time.perf_counter() - start:.0f}"
            for c in CONTEXTS:
                seconds[c][T] = step_seconds(model, T, c, 3 if DRY else 10)
                save_curve(f"{name}-{str(dtype)[6:]}-{mode}-{c}", model=name, shape=shape, dtype=str(dtype), mode=mode,
                           context=c, device=device_name(), seconds={str(k): t for k, t in seconds[c].items()})
            report(f"| {name} | {mode} | {T} | " + " | ".join(
                f"{1e3 * seconds[c][T]:.2f} ({seconds[c][T] / seconds[c][1]:.2f}x)" for c in CONTEXTS)
                + f" | {compile_seconds} |")
    if compiled:
        report(f"\nCUDA graph skips (inductor's count of graphs run without one): {cudagraph_skips()}")
    report()


# --- (c) the real SmolLM2 --------------------------------------------------------------------

def smollm2(compiled: bool) -> bool:
    folder = os.environ.get("MODEL", "")
    if not folder or not (Path(folder) / "config.json").exists():
        report(f"- SmolLM2 did not travel to this machine (MODEL={folder or 'unset'}): not run")
        return True
    from decoding import greedy_decode
    from engine import generate
    from model import STEP_SIZES, Transformer
    from tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(folder)
    start = time.perf_counter()
    model = Transformer.from_pretrained(folder, DEV, torch.float32)
    if compiled:  # as `--compile` loads it: every step size. The dry form traces them only (two
        # minutes of C++ compiling on a CPU; (b) compiles for real on tiny shapes).
        model.compile_steps(STEP_SIZES, 1024, backend="eager" if DRY else "inductor")
        report(f"- compiled {len(model.compiled.sizes)} sizes in {time.perf_counter() - start:.0f} s"
               + (" (traced only: the dry form)" if DRY else f", CUDA graph skips {cudagraph_skips()}") + "\n")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in (
        "Count from 1 to 30, separated by commas.", "Explain what a hash table is in three sentences.",
        "Write a Python function that checks whether a number is prime.")]
    n = 16 if DRY else 64
    runs = [("greedy", lambda ids: greedy_decode(model, ids, n, tok.stop_ids)),
            ("7,5,7", lambda ids: generate(model, ids, n, window=7, ngram=5, candidates=7, stop_ids=tok.stop_ids)),
            ("dynamic", lambda ids: generate(model, ids, n, stop_ids=tok.stop_ids))]
    for _, run in runs:
        run(prompts[0])  # warm-up
    step = "compiled" if compiled else "eager"
    report(f"| SmolLM2, float32, {step} | tokens/s | x greedy | tokens/step | host ms/step | host syncs/step | same as greedy |")
    report("|---|---|---|---|---|---|---|")
    base, rate0, exact = [], None, True
    for name, run in runs:
        gens, syncs = zip(*(counted_syncs(lambda: run(ids)) for ids in prompts))
        base = base or [g.tokens for g in gens]
        steps = sum(g.steps for g in gens)
        rate = sum(len(g.tokens) for g in gens) / sum(g.seconds for g in gens)
        rate0 = rate0 or rate
        same = [g.tokens for g in gens] == base
        exact &= same
        report(f"| {name} | {rate:.1f} | {rate / rate0:.2f} | {sum(sum(g.committed) for g in gens) / steps:.2f} | "
               f"{1e3 * sum(g.host_seconds for g in gens) / steps:.2f} | "
               f"{'-' if syncs[0] is None else f'{sum(syncs) / steps:.2f}'} | {'yes' if same else 'NO'} |")
    return exact


# --- the parts, each in its own process ------------------------------------------------------

# Most valuable first; caps from the H200's run (docs/PERFORMANCE.md): a compiled graph takes
# 60-100 s there, and a model compiles two (size 1, and every size from 2). What is left of
# TOTAL caps each part, and a part with less than a minute left is dropped, saying so.
PARTS = {  # key: (title, cap in seconds on a GPU, on a CPU's dry form, what it runs)
    "a": ("(a) exactness: tiny models of every family", 60, 90, exactness),
    "b-eager": ("(b) the step-cost curves, eager", 40, 60, lambda: [curve(name, False) for name in (SMALL, LARGE)]),
    "b-small": (f"(b) the step-cost curve, compiled, {SMALL}", 180, 120, lambda: curve(SMALL, True)),
    "c-eager": ("(c) the real SmolLM2, eager", 40, 90, lambda: smollm2(False)),
    "c-compiled": ("(c) the real SmolLM2, compiled", 180, 150, lambda: smollm2(True)),
    "b-large": (f"(b) the step-cost curve, compiled, {LARGE}", 180, 120, lambda: curve(LARGE, True)),
}
TOTAL = 600 if DRY else 480  # seconds for every part together (a GPU's: 8 minutes)
LEAST = 60  # a part with less than this left of TOTAL is not started


def run_part(key: str) -> int:
    """In the part's own process: its exit status (0, 1 if it raised, WRONG if an answer was)."""
    try:
        return 0 if PARTS[key][3]() is not False else WRONG
    except Exception as e:
        report(f"- FAILED: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()  # the whole traceback in gpu.log
        return 1


def main() -> int:
    started = time.time()
    report(f"# GPU check: {device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}"
           + (" (dry form: tiny shapes)" if DRY else ""))
    caps = {key: cap_dry if DRY else cap for key, (_, cap, cap_dry, _) in PARTS.items()}
    report("caps: " + ", ".join(f"{key} {cap} s" for key, cap in caps.items()) + f"; {TOTAL} s in all at most")
    failed, ran_out, dropped = [], [], []
    for key, (title, *_) in PARTS.items():
        left = TOTAL - (time.time() - started)
        report(f"\n## {title} (+{time.time() - started:.0f} s, cap {min(caps[key], max(left, 0)):.0f} s)\n")
        if left < LEAST:
            dropped.append(key)
            report(f"- dropped: {left:.0f} s left of the check's {TOTAL} s, under the {LEAST} s a part needs")
            continue
        caps[key] = int(min(caps[key], left))
        start = time.perf_counter()
        # A process group of its own: inductor's compile workers die with it when the cap runs out.
        env = dict(os.environ, TORCH_LOGS=os.environ.get("TORCH_LOGS", "perf_hints"))
        proc = subprocess.Popen([sys.executable, __file__, key], start_new_session=True, env=env)
        try:
            status = proc.wait(timeout=caps[key])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = None
            ran_out.append(key)
            report(f"- its cap of {caps[key]} s ran out: stopped, what it wrote above stands")
        if status:
            failed.append(key)
            report(f"- FAILED ({'an answer differed from greedy' if status == WRONG else f'exit status {status}'})")
        report(f"\n[{key}: {time.perf_counter() - start:.0f} s]")
    report(f"\n[all parts: {time.time() - started:.0f} s"
           + (f"; caps ran out: {', '.join(ran_out)}" if ran_out else "")
           + (f"; dropped: {', '.join(dropped)}" if dropped else "")
           + (f"; FAILED: {', '.join(failed)}" if failed else "; none failed") + "]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_part(sys.argv[1]) if len(sys.argv) > 1 else main())
