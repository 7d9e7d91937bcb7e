"""Benchmark: greedy vs lookahead decoding, measured side by side, on the same model and prompts.

    python bench.py                                  # SmolLM2-135M-Instruct, the dynamic shape
    python bench.py --configs dynamic 0,4,1 --readme # the README's CPU table
    python bench.py --device cuda --compile --configs dynamic 15,5,15 7,5,7
    python bench.py --sweep --json results.json      # a grid of W,N,G
    python bench.py --batch 8 --max-new-tokens 64    # the prompts one by one vs in batches of 8
    python bench.py --dataset spec-bench --per-category 2 --configs dynamic dynamic:pool,recycling,jacobi \
        --plot spec_bench.png                        # Spec-Bench by category, transformers' peers beside

For every configuration (`dynamic`, or W,N,G): tokens/s, steps, tokens per step, the cost of a step against a greedy
step, the speed-up over greedy (runs alternate greedy / lookahead per prompt, after a warm-up,
median over --repeats), and whether the tokens equal greedy's (they must: "yes"). Prints a
table and the machine it ran on. With --batch B: each decoder one prompt at a time vs B prompts
per batch (tokens/s over all prompts, and whether every row equals its one-by-one output).
With --dataset spec-bench: Spec-Bench's questions turn by turn, per category and overall, with
transformers' greedy generate and prompt lookup decoding in the same run where it is installed.
"""
import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cli import DTYPES, drafts_from, resolve_model
from decoding import greedy_decode, greedy_decode_batch
from lookahead import lookahead_decode, lookahead_decode_batch
from shape import STEP_COSTS, StepCosts
from model import STEP_SIZES, Transformer
from tokenizer import Tokenizer

SUMMARY_TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
    "reefs and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 "
    "square kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. "
    "It can be seen from outer space and is the world's biggest single structure made by living "
    "organisms. This reef structure is composed of and built by billions of tiny organisms, known as "
    "coral polyps. It supports a wide diversity of life and was selected as a World Heritage Site in 1981.")

# (kind, chat?, prompt): chat prompts go through the model's chat template.
PROMPTS = [
    ("list", True, "Count from 1 to 30, separated by commas."),
    ("prose", True, "Explain what a hash table is in three sentences."),
    ("code", True, "Write an SQL query that returns the ten customers with the highest total order amount."),
    ("code", True, "Write a Python function that checks whether a number is prime."),
    ("summary", True, f"Summarise this text in two sentences:\n\n{SUMMARY_TEXT}"),
    ("story", False, "Once upon a time, in a small village by the sea,"),
    ("prose", True, "Explain the difference between a list and a tuple in Python."),
    ("code", True, "Write a JSON object that describes a book: title, author, year and three keywords."),
]

SWEEP = [f"{w},{n},{g}" for n in (3, 4, 5) for w in (1, 3, 7, 15) for g in (1, 3, 7, 15)]


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


@dataclass(frozen=True)
class Config:
    """A lookahead decoder to measure: its name and lookahead_decode's options."""
    name: str
    options: tuple = ()  # (key, value) pairs


def parse_config(text: str) -> Config:
    """`dynamic` or W,N,G, optionally :SOURCES (e.g. dynamic:pool,recycling,jacobi)."""
    shape, _, sources = text.partition(":")
    try:
        options = {} if shape == "dynamic" else dict(zip(("window", "ngram", "candidates"),
                                                          (int(x) for x in shape.split(",", 2))))
        if shape != "dynamic" and len(options) != 3:
            raise ValueError
        if sources:
            options["drafts"] = drafts_from(sources)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"a configuration is W,N,G (e.g. 7,5,7) or dynamic, then optionally "
                                         f":SOURCES (e.g. dynamic:pool,recycling,jacobi), not {text!r} ({e})")
    return Config(text, tuple(options.items()))


def load_prompts(path, tokenizer):
    prompts = PROMPTS
    if path:
        prompts = []
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                prompts.append((row.get("kind", "custom"), row.get("chat", True), row["prompt"]))
    encoded = []
    for kind, chat, text in prompts:
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        encoded.append((kind, tokenizer.encode(text)))
    return encoded


def print_tables(rows, results, labels, markdown):
    """The summary (one row per decoder) and the speed-up of every prompt, as plain columns or
    as the README's Markdown tables."""
    head = ["decoder", "tokens/s", "steps", "tokens/step", "step cost", "speed-up", "per prompt: median", "worst",
            "same as greedy"]
    body = [[r["config"], f"{r['tokens_per_s']:.1f}", str(r["steps"]), f"{r['tokens_per_step']:.2f}",
             f"{r['step_cost']:.2f}x", f"{r['speedup']:.2f}x", f"{statistics.median(r['prompt_speedups']):.2f}x",
             f"{min(r['prompt_speedups']):.2f}x", "yes" if r["identical"] else "NO"] for r in rows]
    per_head = ["prompt"] + [f"{r['config']}: speed-up, tokens/step" for r in rows[1:]]
    per_body = [[label] + [f"{r['prompt_speedups'][i]:.2f}x, "
                           f"{sum(results[r['config']][i][0].committed) / max(results[r['config']][i][0].steps, 1):.2f}"
                           for r in rows[1:]] for i, label in enumerate(labels)]
    for h, b in ((head, body), (per_head, per_body)):
        print_table(h, b, markdown)
        print()


def print_table(head: list[str], body: list[list[str]], markdown: bool):
    """Rows of cells as a Markdown table (the README's) or as aligned columns."""
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print("\n".join("| " + " | ".join(row) + " |" for row in body))
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        for row in [head] + body:
            print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


def names_of(configs):
    return ["greedy"] + [c.name for c in configs]


def bench_batch(model, prompts, B, configs, names, greedy, lookahead, n_new, stop, costs, repeats, markdown):
    """Every decoder over all prompts, one at a time and in batches of B (alternating, median
    of `repeats` runs); each batched row must equal its one-by-one output."""
    def batched(cfg):
        out = []
        for i in range(0, len(prompts), B):
            chunk = list(prompts[i:i + B])
            if cfg == "greedy":
                out += greedy_decode_batch(model, chunk, n_new, stop)
            else:
                out += lookahead_decode_batch(model, chunk, n_new, stop_ids=stop, costs=costs, **dict(cfg.options))
        return out

    def one_by_one(cfg):
        return [greedy(ids) if cfg == "greedy" else lookahead(ids, cfg) for ids in prompts]

    batched(configs[0])  # warm-up at this batch size
    rows = []
    for name, cfg in zip(names, ["greedy"] + configs):
        seconds = {"one": [], "batch": []}
        for _ in range(repeats):
            for kind, run in (("one", one_by_one), ("batch", batched)):
                start = time.perf_counter()
                gens = run(cfg)
                seconds[kind].append(time.perf_counter() - start)
                if kind == "one":
                    want = [g.tokens for g in gens]
                else:
                    same = [g.tokens for g in gens] == want
        tokens = sum(len(t) for t in want)
        one, batch = (tokens / statistics.median(seconds[k]) for k in ("one", "batch"))
        rows.append([name, f"{one:.1f}", f"{batch:.1f}", f"{batch / one:.2f}x", "yes" if same else "NO"])
    base = float(rows[0][1])
    for row in rows:
        row.insert(3, f"{float(row[2]) / base:.2f}x")
    head = ["decoder", "one by one: tokens/s", f"batches of {B}: tokens/s", "batched vs greedy one by one",
            "batched vs one by one", "rows same as one by one"]
    print_table(head, rows, markdown)
    return 0 if all(r[-1] == "yes" for r in rows) else 1


SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"


def spec_bench_questions(per_category: int) -> list[dict]:
    """Spec-Bench's questions, the first `per_category` of each of its 13 categories in the
    file's own order (so K=2 takes questions 81-82, 91-92, ... of MT-Bench and the first two of
    translation, summarization, qa, math_reasoning and rag)."""
    chosen, seen = [], {}
    for line in SPEC_BENCH.read_text().splitlines():
        q = json.loads(line)
        seen[q["category"]] = seen.get(q["category"], 0) + 1
        if seen[q["category"]] <= per_category:
            chosen.append(q)
    return chosen


def transformers_peers(path, device, dtype, n_new, stop):
    """transformers' greedy generate and its prompt lookup decoding on the same checkpoint, as
    name -> run(ids) -> (tokens, forward passes after the prefill, seconds); {} where transformers
    is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers is not installed: its greedy and prompt lookup decoding are skipped", flush=True)
        return {}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    calls = [0]
    hf.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    @torch.inference_mode()
    def run(ids, **options):
        calls[0] = 0
        start = time.perf_counter()
        out = hf.generate(torch.tensor([ids], device=device), max_new_tokens=n_new, do_sample=False, top_p=None,
                          top_k=None, temperature=None, eos_token_id=list(stop), pad_token_id=stop[0], **options)
        timed(lambda: None, device)
        return out[0, len(ids):].tolist(), calls[0] - 1, time.perf_counter() - start

    return {"transformers greedy": run, "transformers PLD": lambda ids: run(ids, prompt_lookup_num_tokens=10)}


def bench_spec_bench(model, tokenizer, path, configs, greedy, lookahead, args, device):
    """Spec-Bench, turn by turn (a second turn follows the model's own greedy first answer), every
    decoder alternating with our greedy on each answer, median of --repeats; then per category
    and overall: tokens per step, speed-up over our greedy, identity with it on every answer."""
    questions = spec_bench_questions(args.per_category)
    peers = transformers_peers(path, device, model.dtype, args.max_new_tokens, tokenizer.stop_ids) if args.peers else {}
    names = ["greedy"] + [c.name for c in configs] + list(peers)
    runs = {name: (lambda ids, c=c: lookahead(ids, c)) for name, c in zip(names[1:], configs)}
    answers = []  # one record per answer
    for q in questions:
        messages = []
        for turn, text in enumerate(q["turns"]):
            messages.append({"role": "user", "content": text})
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
            record = dict(question_id=q["question_id"], category=q["category"], turn=turn + 1, prompt_tokens=len(ids))
            seconds = {name: [] for name in names}
            for _ in range(args.repeats):
                ref = timed(lambda: greedy(ids), device)
                seconds["greedy"].append(ref.seconds)
                for name in names[1:]:
                    if name in peers:
                        tokens, steps, secs = peers[name](ids)
                    else:
                        gen = timed(lambda: runs[name](ids), device)
                        tokens, steps, secs = gen.tokens, gen.steps, gen.seconds
                    seconds[name].append(secs)
                    record[name] = dict(tokens=len(tokens), steps=steps, identical=tokens == ref.tokens)
            record["greedy"] = dict(tokens=len(ref.tokens), steps=ref.steps, identical=True)
            for name in names:
                record[name]["seconds"] = statistics.median(seconds[name])
            answers.append(record)
            stop = set(tokenizer.stop_ids)
            messages.append({"role": "assistant", "content": tokenizer.decode([t for t in ref.tokens if t not in stop])})
    return names, answers


def print_spec_bench(names, answers, markdown, step_costs):
    """Per category (Spec-Bench's order) and overall: tokens per step and speed-up over our greedy
    for every decoder; `same` says whether every answer equals our greedy's."""
    categories = list(dict.fromkeys(a["category"] for a in answers)) + ["overall"]
    head = ["category", "answers"] + [f"{n}: tokens/step, speed-up" for n in names[1:]] + ["all same as greedy"]
    body, summary = [], {}
    for cat in categories:
        group = [a for a in answers if cat in ("overall", a["category"])]
        cells = [cat, str(len(group))]
        greedy_s = sum(a["greedy"]["seconds"] for a in group)
        for n in names[1:]:
            steps = sum(a[n]["steps"] for a in group)  # after the prefill, which gives the first token
            per_step = sum(a[n]["tokens"] - 1 for a in group) / steps if steps else 1.0
            speedup = greedy_s / sum(a[n]["seconds"] for a in group)
            summary[(cat, n)] = (per_step, speedup)
            cells.append(f"{per_step:.2f}, {speedup:.2f}x")
        cells.append("yes" if all(a[n]["identical"] for a in group for n in names) else "NO")
        body.append(cells)
    print_table(head, body, markdown)
    print()
    if step_costs:
        print("step cost on this machine, as the dynamic shape measured it (x a 1-token step): "
              + ", ".join(f"{size} tokens {cost:.2f}x" for size, cost in step_costs.items()))
    return categories, summary


def plot_spec_bench(file, names, categories, summary):
    """Tokens per step and speed-up per category and decoder, as bars (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib); the tables above are complete") from None
    fig, axes = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    width = 0.8 / len(names[1:])
    for i, n in enumerate(names[1:]):
        xs = [c + (i - (len(names) - 2) / 2) * width for c in range(len(categories))]
        for ax, k in zip(axes, (0, 1)):
            ax.bar(xs, [summary[(cat, n)][k] for cat in categories], width, label=n)
    axes[0].set_ylabel("tokens per step")
    axes[1].set_ylabel("speed-up over greedy")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    axes[0].legend(fontsize=8, ncol=3)
    axes[0].set_title("Spec-Bench, by category")
    fig.tight_layout()
    fig.savefig(file, dpi=110)


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    gen = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return gen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: the tests' SmolLM2-135M-Instruct, "
                                                  "built once by models/smollm2.py)")
    ap.add_argument("--configs", nargs="+", type=parse_config, default=None,
                    help="W,N,G configurations or `dynamic`, each optionally :SOURCES, the draft sources in order "
                         "(e.g. dynamic:pool,recycling,jacobi; default: dynamic with pool,jacobi)")
    ap.add_argument("--flat-cost", action="store_true",
                    help="the dynamic shape assumes every step size costs the same (what it does where steps are free)")
    ap.add_argument("--sweep", action="store_true", help=f"run a grid of {len(SWEEP)} configurations")
    ap.add_argument("--prompts", default=None, help='JSONL file of {"prompt": ..., "chat": true}')
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--readme", action="store_true", help="print the tables in the README's Markdown format")
    ap.add_argument("--compile", action="store_true", help="compile the step sizes first (Transformer.compile_steps)")
    ap.add_argument("--batch", type=int, default=0, metavar="B", help="compare one by one with batches of B prompts")
    ap.add_argument("--dataset", choices=["spec-bench"], default=None,
                    help="Spec-Bench's questions (data/spec_bench) instead of the built-in prompts, by category")
    ap.add_argument("--per-category", type=int, default=2, metavar="K",
                    help="with --dataset: the first K questions of each category (default 2)")
    ap.add_argument("--no-peers", dest="peers", action="store_false",
                    help="with --dataset: leave out transformers' greedy and prompt lookup decoding")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="with --dataset: draw the table (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.batch < 0 or args.batch == 1 or (args.batch and args.compile):
        ap.error("--batch takes B >= 2, and runs uncompiled (a compiled model decodes one sequence at a time)")

    path = args.model
    if path is None:  # the checkpoint the tests check against transformers (models/README.md)
        builder = Path(__file__).resolve().parent / "models" / "smollm2.py"
        path = subprocess.run([sys.executable, str(builder)], check=True, capture_output=True,
                              text=True).stdout.strip().splitlines()[-1]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        path = resolve_model(path)
        model = Transformer.from_pretrained(path, device, DTYPES[args.dtype])
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compile_seconds = 0.0
    if args.compile:
        start = time.perf_counter()
        model.compile_steps(STEP_SIZES)
        compile_seconds = time.perf_counter() - start
    dtype = model.dtype
    tokenizer = Tokenizer.from_pretrained(path)
    kinds, prompts = zip(*load_prompts(args.prompts, tokenizer))
    stop = tokenizer.stop_ids
    configs = [parse_config(c) for c in ["dynamic"] + SWEEP] if args.sweep else args.configs or [parse_config("dynamic")]
    costs = StepCosts.flat() if args.flat_cost else None
    n_new = args.max_new_tokens

    def greedy(ids):
        return greedy_decode(model, ids, n_new, stop)

    def lookahead(ids, cfg):  # costs: the dynamic shape's (a fixed one has none)
        return lookahead_decode(model, ids, n_new, stop_ids=stop, costs=costs, **dict(cfg.options))

    command = "python bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{'' if args.readme else '# '}`{command}`: {machine(device)}, {str(dtype).removeprefix('torch.')}, "
          f"{f'Spec-Bench, {args.per_category} per category' if args.dataset else f'{len(prompts)} prompts'} x {n_new} "
          f"tokens, median of {args.repeats} runs"
          + (f", compiled in {compile_seconds:.0f} s" if args.compile else "") + (":\n" if args.readme else ""), flush=True)
    for ids in prompts[:2]:  # warm-up: allocator, caches, kernels
        greedy(ids), lookahead(ids, configs[0])
    if args.batch:
        return bench_batch(model, prompts, args.batch, configs, names_of(configs), greedy, lookahead, n_new, stop,
                           costs, args.repeats, args.readme)
    if args.dataset:
        names, answers = bench_spec_bench(model, tokenizer, path, configs, greedy, lookahead, args, device)
        measured = STEP_COSTS.get(model, {}).get(1)
        sizes = [s for s in STEP_SIZES[:5] if measured and measured.estimate(s)]
        step_costs = {s: measured.estimate(s) / measured.estimate(1) for s in sizes} if 1 in sizes else {}
        categories, summary = print_spec_bench(names, answers, args.readme, step_costs)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(machine=machine(device), dtype=str(dtype), max_new_tokens=n_new,
                                                       repeats=args.repeats, answers=answers), indent=1))
        if args.plot:
            plot_spec_bench(args.plot, names, categories, summary)
        return 0 if all(a[n]["identical"] for a in answers for n in names) else 1

    # seconds[name][repeat] summed over prompts; greedy and each config alternate per prompt so
    # that drifts in machine speed hit all of them alike.
    names = names_of(configs)
    seconds = {name: [0.0] * args.repeats for name in names}
    per_prompt = {name: [[] for _ in prompts] for name in names}  # [prompt][repeat] seconds
    results = {name: [] for name in names}
    for r in range(args.repeats):
        for i, ids in enumerate(prompts):
            ref = timed(lambda: greedy(ids), device)
            seconds["greedy"][r] += ref.seconds
            per_prompt["greedy"][i].append(ref.seconds)
            if r == 0:
                results["greedy"].append((ref, True))
            for name, cfg in zip(names[1:], configs):
                gen = timed(lambda: lookahead(ids, cfg), device)
                seconds[name][r] += gen.seconds
                per_prompt[name][i].append(gen.seconds)
                if r == 0:
                    results[name].append((gen, gen.tokens == ref.tokens))

    # speed-up = (greedy steps / steps) / step cost: what the algorithm saves in steps, divided
    # by what a step costs against a greedy step (1.0 would mean the extra tokens were free).
    rows = []
    base = statistics.median(seconds["greedy"])
    base_steps = sum(g.steps for g, _ in results["greedy"])
    for name in names:
        gens = results[name]
        tokens = sum(len(g.tokens) for g, _ in gens)
        steps = sum(g.steps for g, _ in gens)
        secs = statistics.median(seconds[name])
        speedups = [statistics.median(g) / statistics.median(s) for g, s in zip(per_prompt["greedy"], per_prompt[name])]
        rows.append(dict(config=name, tokens=tokens, steps=steps, prompt_speedups=speedups,
                         tokens_per_step=sum(sum(g.committed) for g, _ in gens) / max(steps, 1),
                         tokens_per_s=tokens / secs, speedup=base / secs,
                         step_cost=(secs / max(steps, 1)) / (base / max(base_steps, 1)),
                         identical=all(same for _, same in gens)))
    labels = [f"{i + 1} {kind}" for i, kind in enumerate(kinds)]
    print_tables(rows, results, labels, args.readme)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=machine(device), dtype=str(dtype), device=str(device),
                                                   max_new_tokens=n_new, repeats=args.repeats, rows=rows), indent=1))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
