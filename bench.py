"""Benchmark: greedy vs lookahead decoding, measured side by side, on the same model and prompts.

    python bench.py                                  # SmolLM2-135M-Instruct, the dynamic shape
    python bench.py --configs dynamic 0,4,1 --markdown # docs/PERFORMANCE.md's CPU table
    python bench.py --device cuda --compile --configs dynamic 15,5,15 7,5,7
    python bench.py --sweep --json results.json      # a grid of W,N,G
    python bench.py --batch 8 --max-new-tokens 64    # the prompts one by one vs in batches of 8
    python bench.py --long --max-new-tokens 128      # ~500 to ~6,000-token summaries, prefill and decode apart
    python bench.py --busy                           # beside a process that keeps a core busy: a shared machine
    python bench.py --control                        # greedy-again beside greedy: what this machine's noise reads
    python bench.py --dataset spec-bench --questions 81 102 --repeats 15 --control --no-peers
                                                     # a few answers, each with its paired 90% interval
    python bench.py --peers                          # transformers' greedy, prompt lookup and lookahead beside
    python bench.py --contexts 2048 32768 131072     # compiled: K/V allocated and a step's cost per context
    python bench.py --dataset spec-bench --per-category 2 --configs dynamic dynamic:pool,recycling,jacobi \
        --plot spec_bench.png                        # Spec-Bench by category, transformers' peers beside

For every configuration (`dynamic`, or W,N,G): tokens/s, steps, tokens per step, the cost of a step against a greedy
step, the speed-up over greedy (runs alternate greedy / lookahead per prompt, the configs in an
order rotating each repeat, after a warm-up, median over --repeats), and whether the tokens
equal greedy's (they must: "yes"). With 5 repeats or more, each prompt's speed-up also as the
median of its repeats' paired ratios with a bootstrap 90% interval, and the prompts counted by
where their interval lies (below 1.0x: slower than greedy beyond the run's noise). Prints a
table and the machine it ran on. With --batch B: each decoder one prompt at a time vs B prompts
per batch (tokens/s over all prompts, and whether every row equals its one-by-one output).
With --dataset spec-bench: Spec-Bench's questions turn by turn, per category and overall, with
transformers' greedy generate, its prompt lookup decoding and lookahead through its generate
(hf_backend) in the same run where it is installed (--peers: on the built-in prompts too);
--warm adds each configuration again, warm: a drafts.Memory carried through the questions in
file order (each timed repeat starts from what the answers before it left, never from its own).
"""
import argparse
import copy
import json
import platform
import random
import re
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from cli import DTYPES, build_default_model, drafts_from, resolve_model
from decoding import greedy_decode, greedy_decode_batch
from drafts import Memory
from engine import generate, generate_batch
from shape import StepCosts
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
    """A lookahead decoder to measure: its name and engine.generate's options."""
    name: str
    options: tuple = ()  # (key, value) pairs


# The control (--control): our greedy decoding each prompt a second time, in the rotation as one more
# decoder. An identical decoder's speed-ups over greedy are the run's noise: a decoder's per-prompt
# speed-up within the control's spread says nothing of which is faster.
CONTROL = Config("greedy-again")


def parse_config(text: str) -> Config:
    """`dynamic` or W,N,G, optionally :SOURCES (e.g. dynamic:pool,recycling,jacobi), optionally
    named NAME=... (the tables' column; default: the whole text)."""
    name, spec = text.split("=", 1) if re.fullmatch(r"[A-Za-z_][\w.+-]*=.+", text) else (text, text)
    if name in ("greedy", CONTROL.name):
        raise argparse.ArgumentTypeError("greedy is the baseline every table has (greedy-again, --control's "
                                         "second run of it): name the configuration otherwise")
    shape, _, sources = spec.partition(":")
    try:
        options = {} if shape == "dynamic" else dict(zip(("window", "ngram", "candidates"),
                                                          (int(x) for x in shape.split(",", 2))))
        if shape != "dynamic" and len(options) != 3:
            raise ValueError
        if sources:
            options["drafts"] = drafts_from(sources)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"a configuration is [NAME=]W,N,G (e.g. 7,5,7) or [NAME=]dynamic, then "
                                         f"optionally :SOURCES (e.g. fast=dynamic:pool,recycling,jacobi), not {text!r} ({e})")
    return Config(name, tuple(options.items()))


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
    """The summary (one row per decoder), the speed-up of every prompt and what each draft
    source did, as plain columns or as Markdown tables (docs/PERFORMANCE.md)."""
    head = ["decoder", "tokens/s", "steps", "tokens/step", "step cost", "host ms/step", "speed-up", "per prompt: median",
            "worst", "same as greedy"]
    body = [[r["config"], f"{r['tokens_per_s']:.1f}", str(r["steps"]), f"{r['tokens_per_step']:.2f}",
             f"{r['step_cost']:.2f}x", f"{r['host_ms_per_step']:.2f}" if r["config"] not in ("greedy", CONTROL.name) else "-",
             f"{r['speedup']:.2f}x", f"{statistics.median(r['prompt_speedups']):.2f}x",
             f"{min(r['prompt_speedups']):.2f}x", "yes" if r["identical"] else "NO"] for r in rows]
    per_head = ["prompt"] + [f"{r['config']}: speed-up, tokens/step" for r in rows[1:]]
    per_body = [[label] + [f"{r['prompt_speedups'][i]:.2f}x, "
                           f"{sum(results[r['config']][i][0].committed) / max(results[r['config']][i][0].steps, 1):.2f}"
                           for r in rows[1:]] for i, label in enumerate(labels)]
    for h, b in ((head, body), (per_head, per_body)):
        print_table(h, b, markdown)
        print()
    print_sources({r["config"]: r for r in rows[1:]}, markdown)


def print_peers(peer_results, per_prompt, labels, markdown):
    """transformers' decoders on the built-in prompts: tokens per forward pass after the prefill
    (which gives the first token) and speed-up over our greedy (medians of the repeats, all
    prompts' summed), then each prompt's."""
    greedy = [statistics.median(s) for s in per_prompt["greedy"]]
    head = ["decoder", "tokens/step", "x our greedy", "per prompt: median", "worst", "same as greedy"]
    body, speedups = [], {}
    for name, runs in peer_results.items():
        mine = [statistics.median(s) for s in per_prompt[name]]
        speedups[name] = [g / m for g, m in zip(greedy, mine)]
        body.append([name, f"{sum(t - 1 for t, _, _ in runs) / max(sum(s for _, s, _ in runs), 1):.2f}",
                     f"{sum(greedy) / sum(mine):.2f}x", f"{statistics.median(speedups[name]):.2f}x",
                     f"{min(speedups[name]):.2f}x", "yes" if all(ok for *_, ok in runs) else "NO"])
    print_table(head, body, markdown)
    print()
    per_body = [[label] + [f"{speedups[name][i]:.2f}x, {(runs[i][0] - 1) / max(runs[i][1], 1):.2f}"
                           for name, runs in peer_results.items()] for i, label in enumerate(labels)]
    print_table(["prompt"] + [f"{name}: x our greedy, tokens/step" for name in peer_results], per_body, markdown)
    print()


SOURCE_HEAD = ["decoder", "draft source", "µs a step", "label", "guesses tested", "accepted", "rate",
               "accepted, no other label's"]


def print_sources(rows: dict, markdown: bool):
    """Per decoder and draft source: its propose and observe time per step, and (the dynamic
    shape) per label its guesses that verification tested (their parent accepted), those
    accepted (the rate a prior may be set to: drafts.DraftSource), and those accepted that no
    other label proposed (what the decoder would lose without it)."""
    body = []
    for name, r in rows.items():
        (spent, _), steps, guesses = r["sources"], max(r["steps"], 1), r.get("guesses", {})
        for source in dict.fromkeys([*spent, *guesses]):
            cost = f"{1e6 * spent.get(source, 0.0) / steps:.0f}"
            for label, (tested, accepted, only) in guesses.get(source, {"-": ("-", "-", "-")}).items():
                rate = f"{accepted / tested:.2f}" if label != "-" and tested else "-"
                body.append([name, source, cost, label, str(tested), str(accepted), rate, str(only)])
    if body:
        print_table(SOURCE_HEAD, body, markdown)
        print()


def guesses_of(gens) -> dict:
    """Each draft source's {label: [tested, accepted, only this label]} summed over these generations."""
    out = {}
    for gen in gens:
        for name, labels in gen.source_guesses.items():
            mine = out.setdefault(name, {})
            for label, counts in labels.items():
                mine[label] = [a + b for a, b in zip(mine.get(label, [0, 0, 0]), counts)]
    return out


def source_seconds(gens) -> tuple[dict, float]:
    """Each draft source's seconds (propose and observe) summed over these generations, by name,
    and the seconds of their steps (the prefill left out)."""
    return merged([(g.source_seconds, g.seconds - g.prefill_seconds) for g in gens])


def merged(parts: list[tuple[dict, float]]) -> tuple[dict, float]:
    """(seconds by source, steps' seconds) pairs summed."""
    spent = {}
    for part, _ in parts:
        for name, seconds in part.items():
            spent[name] = spent.get(name, 0.0) + seconds
    return spent, sum(steps for _, steps in parts)


def print_table(head: list[str], body: list[list[str]], markdown: bool):
    """Rows of cells as a Markdown table (docs/PERFORMANCE.md's) or as aligned columns."""
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print("\n".join("| " + " | ".join(row) + " |" for row in body))
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        for row in [head] + body:
            print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


def summary_rows(names, results, seconds, per_prompt) -> list[dict]:
    """One row per decoder over the prompts finished so far (results' length): tokens, steps,
    speed-ups, step cost, host time and what its draft sources did."""
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
                         host_ms_per_step=1000 * sum(g.host_seconds for g, _ in gens) / max(steps, 1),
                         step_cost=(secs / max(steps, 1)) / (base / max(base_steps, 1)),
                         identical=all(same for _, same in gens), sources=source_seconds([g for g, _ in gens]),
                         guesses=guesses_of([g for g, _ in gens])))
    return rows


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
                out += generate_batch(model, chunk, n_new, stop_ids=stop, costs=costs, **dict(cfg.options))
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


def spec_bench_questions(per_category: int, ids=None) -> list[dict]:
    """Spec-Bench's questions, the first `per_category` of each of its 13 categories in the
    file's own order (so K=2 takes questions 81-82, 91-92, ... of MT-Bench and the first two of
    translation, summarization, qa, math_reasoning and rag); or, where `ids` are given, those
    question ids, in the file's order."""
    chosen, seen, every = [], {}, []
    for line in SPEC_BENCH.read_text().splitlines():
        q = json.loads(line)
        seen[q["category"]] = seen.get(q["category"], 0) + 1
        every.append(q["question_id"])
        if q["question_id"] in ids if ids else seen[q["category"]] <= per_category:
            chosen.append(q)
    missing = set(ids or ()) - set(every)
    if missing:
        raise ValueError(f"Spec-Bench has no question {', '.join(map(str, sorted(missing)))} "
                         f"(its ids run from {min(every)} to {max(every)})")
    return chosen


def transformers_peers(path, device, dtype, n_new, stop):
    """transformers' greedy generate, its prompt lookup decoding and lookahead through its
    generate (hf_backend: the dynamic shape, the default sources), all on one transformers model
    of the same checkpoint, as name -> run(ids) -> (tokens, forward passes after the prefill,
    seconds); {} where transformers is not installed."""
    try:
        from transformers import AutoModelForCausalLM
        from hf_backend import lookahead_generate
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

    return {"transformers greedy": run, "transformers PLD": lambda ids: run(ids, prompt_lookup_num_tokens=10),
            "transformers lookahead": lambda ids: run(ids, custom_generate=lookahead_generate)}


def bench_spec_bench(model, tokenizer, path, configs, greedy, lookahead, args, device, on_answer=None):
    """Spec-Bench, turn by turn (a second turn follows the model's own greedy first answer), every
    decoder alternating with our greedy on each answer (their order rotating each repeat), median
    of --repeats; then per category and overall: tokens per step, speed-up over our greedy,
    identity with it on every answer. on_answer(names, answers) after each answer (bench.py
    writes --json and --answers there, so an interrupted run keeps what it finished); a line a
    answer on stderr says how far it is."""
    questions = spec_bench_questions(args.per_category, args.questions)
    total, start = sum(len(q["turns"]) for q in questions), time.perf_counter()
    total = min(total, args.limit or total)
    peers = transformers_peers(path, device, model.dtype, args.max_new_tokens, tokenizer.stop_ids) if args.peers else {}
    ours = ([(c.name, c, False) for c in configs] if args.warm != "only" else []) + [
        (f"{c.name}+warm", c, True) for c in configs if args.warm and c != CONTROL]
    names = ["greedy"] + [name for name, *_ in ours] + list(peers)
    # What the answers so far left, per warm decoder: from --memory's file, where one was given.
    memories = {name: copy.deepcopy(args.start_memory) if args.start_memory else Memory() for name, _, warm in ours if warm}
    runs = {name: (lambda ids, memory=None, c=c: lookahead(ids, c, memory=memory)) for name, c, _ in ours}
    answers = []  # one record per answer
    stop = set(tokenizer.stop_ids)
    answer_text = lambda gen: tokenizer.decode([t for t in gen.tokens if t not in stop])
    for q in questions:
        messages = []
        for turn, text in enumerate(q["turns"]):
            if len(answers) == total:
                break
            messages.append({"role": "user", "content": text})
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
            record = dict(question_id=q["question_id"], category=q["category"], turn=turn + 1, prompt_tokens=len(ids))
            seconds = {name: [] for name in names}
            after = {}  # each warm decoder's memory after its first repeat: the next answer's
            snapshots = {}  # each warm decoder's memory before this answer, where repeats need it
            for r in range(args.repeats):
                ref = timed(lambda: greedy(ids), device)
                seconds["greedy"].append(ref.seconds)
                for name in rotated(names[1:], r):
                    if name in peers:
                        tokens, steps, secs = peers[name](ids)
                    else:
                        # A warm decoder's repeats start from the same memory: the first from the
                        # live one (no copy), later ones from a snapshot taken once per answer.
                        memory = memories.get(name)
                        if memory is not None and args.repeats > 1 and r == 0:
                            snapshots[name] = copy.deepcopy(memory)
                        elif memory is not None and r > 0:
                            memory = copy.deepcopy(snapshots[name])
                        gen = timed(lambda: runs[name](ids, memory), device)
                        tokens, steps, secs = gen.tokens, gen.steps, gen.seconds
                        after.setdefault(name, memory)
                    seconds[name].append(secs)
                    record.setdefault(name, {}).update(tokens=len(tokens), steps=steps, identical=tokens == ref.tokens)
                    if name not in peers and r == 0:  # the first run's answer, sources' seconds, tokens a step
                        record[name].update(sources=source_seconds([gen]), guesses=gen.source_guesses,
                                            accept_lengths=gen.committed, text=answer_text(gen))
            record["greedy"] = dict(tokens=len(ref.tokens), steps=ref.steps, identical=True, accept_lengths=ref.committed,
                                    text=answer_text(ref))
            for name in names:  # the median, and each repeat's (paired_speedup reads them)
                record[name].update(seconds=statistics.median(seconds[name]), runs=seconds[name])
            memories.update(after)
            answers.append(record)
            progress(answers, names, total, time.perf_counter() - start)
            on_answer and on_answer(names, answers)
            messages.append({"role": "assistant", "content": record["greedy"]["text"]})
    if args.memory:
        memory = memories[next(name for name, _, warm in ours if warm)]
        memory.save(args.memory, tokenizer.identity)
        print(f"[memory] {args.memory}: the first warm decoder's memory written", file=sys.stderr)
    return names, answers


def progress(answers, names, total: int, seconds: float):
    """One line on stderr: answers done, each decoder's tokens per step so far, time left."""
    done = len(answers)
    rates = ", ".join(f"{n} {sum(a[n]['tokens'] for a in answers) / max(sum(a[n]['steps'] for a in answers), 1):.2f}"
                      for n in names[1:])
    left = seconds / done * (total - done)
    print(f"[{done}/{total}] {answers[-1]['category']}: tokens/step so far {rates}; "
          f"{seconds / 60:.1f} min, about {left / 60:.1f} min left", file=sys.stderr, flush=True)


def write_answers(folder, names, answers, model_id: str):
    """One answer file per decoder of ours in Spec-Bench's own format (its evaluation/speed.py
    reads them): a JSON line per question with question_id, category, answer_id, model_id,
    tstamp and choices[0]: turns (the answer texts), decoding_steps, new_tokens, wall_time (the
    median of the repeats, seconds) per turn, and accept_lengths (tokens committed by each step,
    every turn's)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if "accept_lengths" not in answers[0][name]:
            continue  # a peer: its steps are not ours to report
        lines = []
        for qid in dict.fromkeys(a["question_id"] for a in answers):
            turns = [a for a in answers if a["question_id"] == qid]
            choice = dict(index=0, turns=[a[name]["text"] for a in turns], decoding_steps=[a[name]["steps"] for a in turns],
                          new_tokens=[a[name]["tokens"] for a in turns], wall_time=[a[name]["seconds"] for a in turns],
                          accept_lengths=[n for a in turns for n in a[name]["accept_lengths"]])
            lines.append(json.dumps(dict(question_id=qid, category=turns[0]["category"], answer_id=uuid.uuid4().hex,
                                         model_id=f"{model_id}-{name}", choices=[choice], tstamp=time.time())))
        (folder / f"{model_id}-{name.replace(':', '-').replace('/', '_').replace(',', '_')}.jsonl").write_text(
            "\n".join(lines) + "\n")


def print_spec_bench(names, answers, markdown, step_costs):
    """Per category (Spec-Bench's order) and overall: tokens per step and speed-up over our greedy
    for every decoder; `same` says whether every answer equals our greedy's. step_costs: (context,
    {size: a step's cost against a 1-token step}), printed under the table."""
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
    ours = [n for n in names[1:] if "sources" in answers[0][n] and n != CONTROL.name]  # not the peers
    print_sources({n: dict(sources=merged([a[n]["sources"] for a in answers]), steps=sum(a[n]["steps"] for a in answers),
                           guesses=guesses_of([SimpleNamespace(source_guesses=a[n]["guesses"]) for a in answers]))
                   for n in ours}, markdown)
    context, costs = step_costs
    print(f"step cost on this machine (an eager step after {context} tokens, the least of 9, x a 1-token step): "
          + ", ".join(f"{size} tokens {cost:.2f}x" for size, cost in costs.items()))
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


LONG_LENGTHS = (500, 2000, 6000)  # --long: documents of about this many tokens


def long_documents(tokenizer, lengths=LONG_LENGTHS) -> list[tuple[int, list[int]]]:
    """Summarisation prompts of about each length: Spec-Bench's summarization articles in the
    file's order, as many as it takes to reach the length (the first one cut to it where it is
    longer), under one instruction, through the chat template."""
    articles = [q["turns"][0].removeprefix("Summarize: ") for q in map(json.loads, SPEC_BENCH.read_text().splitlines())
                if q["category"] == "summarization"]
    documents = []
    for target in lengths:
        text, n = "", 0
        for article in articles:
            if n >= target:
                break
            text += article + "\n\n"
            n = len(tokenizer.encode(text))
        ids = tokenizer.encode(text)[:target]
        doc = tokenizer.decode(ids)
        prompt = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Summarize these news articles in a few sentences.\n\n{doc}"}]))
        documents.append((target, prompt))
    return documents


PEAK_PREFILL = """
import json, sys, torch
from pathlib import Path
path, which, ids, device, dtype = json.loads(sys.argv[1])
dtype = getattr(torch, dtype)
if which == "ours":
    from decoding import ensure_cache, prefill
    from model import Transformer
    model = Transformer.from_pretrained(path, device, dtype)
    run = lambda: (ensure_cache(model, len(ids), 1), prefill(model, [ids]))  # the KV cache counted in
else:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    run = lambda: model(torch.tensor([ids], device=device))  # its cache is made here, counted in
status = lambda f: next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(f))
with torch.inference_mode():
    if device == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
        run(); torch.cuda.synchronize(); print((torch.cuda.max_memory_allocated() - before) / 2 ** 20)
    else:
        Path("/proc/self/clear_refs").write_text("5"); before = status("VmRSS:")
        run(); print((status("VmHWM:") - before) / 1024)
"""


def prefill_peak_mb(path, which, ids, device, dtype) -> float | None:
    """The memory a prefill adds at its peak (MB), in a fresh process so that nothing freed
    earlier hides it: resident memory's high-water mark (Linux), or CUDA's allocated peak."""
    args = json.dumps([str(path), which, ids, device.type, str(dtype).removeprefix("torch.")])
    out = subprocess.run([sys.executable, "-c", PEAK_PREFILL, args], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent)
    return float(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else None


def step_costs_at(model, committed: int, sizes=(1, 4, 16, 64), repeats=5) -> dict[int, float]:
    """Seconds of an eager step of each size after `committed` tokens (the least of `repeats`):
    how a step's cost grows with the context."""
    out = {}
    with torch.inference_mode():
        for T in sizes:
            idx = torch.arange(T, device=model.device)[None]
            C = torch.full((1, 1), committed, device=model.device)
            mask = torch.ones(1, T, T, dtype=torch.bool, device=model.device).tril()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                timed(lambda: model.step(idx % 8, C + idx, C, mask, (committed, committed)), model.device)
                times.append(time.perf_counter() - start)
            out[T] = min(times)
    return out


def bench_long(model, tokenizer, path, configs, greedy, lookahead, args, device):
    """--long: summaries of documents of ~500, ~2,000 and ~6,000 tokens, the prefill and the
    decode timed apart. Prefill: ours (in chunks, decoding.prefill) and transformers' forward over
    the prompt, tokens/s and the memory each adds at its peak, the KV cache included. Decode:
    tokens/s after the first token, speed-up over our greedy's decode, tokens per step, identity.
    Then a step's cost by its size at each context (how the decode's cost grows)."""
    from decoding import ensure_cache, prefill
    hf = None
    if args.peers:
        try:
            from transformers import AutoModelForCausalLM
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype).to(device).eval()
        except ImportError:
            print("transformers is not installed: its prefill is skipped", flush=True)
    names = ["greedy"] + [c.name for c in configs]
    head = ["prompt tokens", "prefill tokens/s", "peak MB"] + (["transformers tokens/s", "peak MB", "ours vs"] if hf else [])
    head += [f"{n}: decode tokens/s" for n in names] + [f"{n}: tokens/step, decode speed-up" for n in names[1:]]
    head += ["same as greedy"]
    body = []
    costs = {}
    for target, ids in long_documents(tokenizer, args.long or LONG_LENGTHS):
        ours, theirs = [], []
        with torch.inference_mode():
            ensure_cache(model, len(ids) + args.max_new_tokens, 1)
            for _ in range(args.repeats):  # the prefill alone, alternating with transformers'
                start = time.perf_counter()
                timed(lambda: prefill(model, [ids]), device)
                ours.append(time.perf_counter() - start)
                if hf:
                    start = time.perf_counter()
                    timed(lambda: hf(torch.tensor([ids], device=device)), device)
                    theirs.append(time.perf_counter() - start)
        costs[len(ids)] = step_costs_at(model, len(ids))
        decode = {n: [] for n in names}
        for _ in range(args.repeats):
            ref = timed(lambda: greedy(ids), device)
            decode["greedy"].append(ref.seconds - ref.prefill_seconds)
            gens = {"greedy": ref}
            for name, cfg in zip(names[1:], configs):
                gens[name] = timed(lambda: lookahead(ids, cfg), device)
                decode[name].append(gens[name].seconds - gens[name].prefill_seconds)
        n_decoded = len(ref.tokens) - 1
        rate = {n: n_decoded / statistics.median(decode[n]) for n in names}
        mb = [prefill_peak_mb(path, which, ids, device, model.dtype) for which in ["ours"] + (["transformers"] if hf else [])]
        row = [str(len(ids)), f"{len(ids) / statistics.median(ours):.0f}", f"{mb[0]:.0f}" if mb[0] is not None else "?"]
        if hf:
            row += [f"{len(ids) / statistics.median(theirs):.0f}", f"{mb[1]:.0f}" if mb[1] is not None else "?",
                    f"{statistics.median(theirs) / statistics.median(ours):.2f}x"]
        row += [f"{rate[n]:.1f}" for n in names]
        row += [f"{gens[n].tokens_per_step:.2f}, {rate[n] / rate['greedy']:.2f}x" for n in names[1:]]
        row.append("yes" if all(gens[n].tokens == ref.tokens for n in names) else "NO")
        body.append(row)
        print(f"{target}-token document done", file=sys.stderr, flush=True)
    print_table(head, body, args.markdown)
    print()
    sizes = list(next(iter(costs.values())))
    print_table(["context (tokens)"] + [f"{T}-token step: ms, x a 1-token step at {min(costs)}" for T in sizes],
                [[str(n)] + [f"{c[T] * 1e3:.0f}, {c[T] / costs[min(costs)][1]:.2f}x" for T in sizes]
                 for n, c in costs.items()], args.markdown)
    return 0 if all(row[-1] == "yes" for row in body) else 1


def bench_contexts(path, contexts, device, dtype, compile_sizes=(1, 8), committed=500, repeats=15):
    """--contexts: the same checkpoint with config.json's max_position_embeddings set to each of
    `contexts` (a temporary copy, the weights linked), loaded compiled with default arguments:
    the K/V it allocates, its compile time, and a step's cost at `committed` tokens, alternating
    between the contexts (the least of `repeats`), against the first context's."""
    import shutil
    import tempfile
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in contexts:
            folder = Path(tmp) / str(n)
            folder.mkdir()
            for f in Path(path).iterdir():
                (folder / f.name).symlink_to(f.resolve())
            config = json.loads((Path(path) / "config.json").read_text())
            (folder / "config.json").unlink()
            (folder / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=n)))
            model = Transformer.from_pretrained(folder, device, dtype)
            if n == contexts[0]:  # the same model eager, for comparison
                model.cache.setup(min(2 * committed, model.args.max_seq_len))
                models["eager"] = model, 0.0, sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                                                  if name.endswith("_cache"))
                model = Transformer.from_pretrained(folder, device, dtype)
            start = time.perf_counter()
            model.compile_steps(compile_sizes)
            kv = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith("_cache"))
            models[n] = model, time.perf_counter() - start, kv
        seconds = {(n, T): [] for n in models for T in compile_sizes}
        with torch.inference_mode():
            for _ in range(repeats):
                for n, (model, _, _) in models.items():
                    for T in compile_sizes:
                        idx = torch.arange(T, device=device)[None]
                        C = torch.full((1, 1), committed, device=device)
                        mask = torch.ones(1, T, T, dtype=torch.bool, device=device).tril()
                        start = time.perf_counter()
                        timed(lambda: model.step(idx % 8, C + idx, C, mask, (committed, committed)), device)
                        seconds[n, T].append(time.perf_counter() - start)
    head = ["max_position_embeddings", "cache slots", "K/V allocated (MB)", "compile (s)"]
    head += [f"{T}-token step at {committed} (ms), vs {contexts[0]}" for T in compile_sizes]
    body = [[f"{contexts[0]}, eager" if n == "eager" else str(n), str(model.cache.slots), f"{kv / 2 ** 20:.0f}",
             "-" if n == "eager" else f"{secs:.0f}"]
            + [f"{min(seconds[n, T]) * 1e3:.1f}, {min(seconds[n, T]) / min(seconds[contexts[0], T]):.2f}x"
               for T in compile_sizes] for n, (model, secs, kv) in models.items()]
    print_table(head, body, False)
    return 0


# The fewest repeats that give an answer's paired speed-up an interval (paired_speedup): with
# fewer, a bootstrap of the median only restates the runs.
INTERVAL_REPEATS = 5


def paired_speedup(greedy_seconds: list[float], seconds: list[float], resamples: int = 2000):
    """One answer's speed-up over greedy from its repeats, each repeat a pair run side by side
    (so a drift in the machine's pace hits both): the median of the pairs' ratios (greedy's
    seconds over the decoder's), and a bootstrap 90% interval of that median, or None with fewer
    than INTERVAL_REPEATS pairs. Where the interval lies below 1.0x, the answer is slower than
    greedy beyond this run's noise; about one answer in twenty of an identical decoder lands
    outside its interval's side by chance (--control shows how many do in the run)."""
    ratios = [g / s for g, s in zip(greedy_seconds, seconds)]
    median = statistics.median(ratios)
    if len(ratios) < INTERVAL_REPEATS:
        return median, None
    rng = random.Random(0)  # the same runs give the same interval
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return median, (medians[resamples // 20], medians[resamples - 1 - resamples // 20])


def print_noise(names, runs: list[dict], labels: list[str], markdown: bool) -> dict:
    """With INTERVAL_REPEATS repeats or more: every decoder's answers by where their paired
    speed-up's 90% interval lies (paired_speedup), above 1.0x, across it, below 1.0x or below
    0.9x, then each answer below 1.0x beyond the noise by name. runs[i][name]: answer i's
    seconds, a repeat each. Returns {name: [(label, median, (low, high)), ...]}."""
    if len(runs[0]["greedy"]) < INTERVAL_REPEATS:
        return {}
    out = {name: [(label, *paired_speedup(r["greedy"], r[name])) for label, r in zip(labels, runs)] for name in names[1:]}
    head = ["decoder", "answers", "paired speed-up: median", "interval above 1.0x", "across 1.0x", "below 1.0x",
            "below 0.9x"]
    body = [[name, str(len(rows)), f"{statistics.median(m for _, m, _ in rows):.2f}x",
             *(str(sum(test(lo, hi) for _, _, (lo, hi) in rows)) for test in (
                 lambda lo, hi: lo > 1.0, lambda lo, hi: lo <= 1.0 <= hi, lambda lo, hi: hi < 1.0, lambda lo, hi: hi < 0.9))]
            for name, rows in out.items()]
    print(f"Each answer's speed-up as the median of its {len(runs[0]['greedy'])} paired runs, and where its "
          f"bootstrap 90% interval lies:")
    print_table(head, body, markdown)
    for name, rows in out.items():
        below = [f"{label} {m:.3f}x ({lo:.3f}-{hi:.3f})" for label, m, (lo, hi) in rows if hi < 1.0]
        if below:
            print(f"{name}, below 1.0x beyond the noise: " + "; ".join(below))
    print()
    return {name: [[label, m, list(interval)] for label, m, interval in rows] for name, rows in out.items()}


def add_to_json(path, **fields):
    """Fields added to the results --json already wrote (tables printed after the run's own)."""
    Path(path).write_text(json.dumps(dict(json.loads(Path(path).read_text()), **fields), indent=1))


def rotated(decoders: list, r: int) -> list:
    """The decoders after greedy in repeat r's order: each repeat starts one further along, so
    none always runs right after greedy (on this VM a run's place in the order moves it ~1%)."""
    r %= max(len(decoders), 1)
    return decoders[r:] + decoders[:r]


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    gen = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return gen


def load_curve(spec: str) -> dict[int, float]:
    """A step-cost curve: FILE holding {"seconds": {"1": s, "2": s, ...}} (other keys say where it
    was measured), or FILE:LABEL, the curve LABEL of a file of several (.ci/gpu's curves.json):
    seconds a step by step size. A ValueError names what is wrong with it."""
    path, label = (spec, None) if Path(spec).exists() or ":" not in spec else spec.rsplit(":", 1)
    try:
        data = json.loads(Path(path).read_text())
        if label is None and "seconds" not in data:
            raise ValueError(f"a file of several curves: name one as {path}:LABEL ({', '.join(data)})")
        if label is not None and label not in data:
            raise ValueError(f"no curve {label!r} in it ({', '.join(data)})")
        seconds = (data if label is None else data[label])["seconds"]
        curve = {int(size): float(t) for size, t in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--costs {spec}: not a step-cost curve ({type(e).__name__}: {e})") from None
    if 1 not in curve or any(t <= 0 for t in curve.values()):
        raise ValueError(f"--costs {spec}: a curve needs a 1-token step and positive seconds")
    return curve


def projected_speedup(gens, greedy_steps: int, curve: dict[int, float]) -> float | None:
    """Greedy's steps at the curve's 1-token cost over these steps at the curve's cost of each
    one's size (host work not counted); None where a step's size is not on the curve."""
    sizes = [shape.size if shape is not None else 1 for g in gens for shape in (g.shapes or [None] * g.steps)]
    if any(size not in curve for size in sizes):
        return None
    return greedy_steps * curve[1] / sum(curve[size] for size in sizes)


def print_projection(rows, results, greedy_steps: int, curve: dict[int, float], path):
    print(f"\nunder the step-cost curve {path} (sizes {', '.join(map(str, sorted(curve)))}; host work not counted):")
    for row in rows:
        row["projected_speedup"] = projected_speedup([g for g, _ in results[row["config"]]], greedy_steps, curve)
        x = row["projected_speedup"]
        print(f"  {row['config']}: {row['tokens_per_step']:.2f} tokens/step, projected speed-up over greedy "
              + (f"{x:.2f}x" if x is not None else "- (a step size off the curve)"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: the tests' SmolLM2-135M-Instruct, "
                                                  "built once by models/smollm2.py)")
    ap.add_argument("--configs", nargs="+", type=parse_config, default=None,
                    help="W,N,G configurations or `dynamic`, each optionally :SOURCES, the draft sources in order "
                         "(e.g. dynamic:pool,recycling,jacobi; default: dynamic with pool,suffix,jacobi)")
    ap.add_argument("--flat-cost", type=int, nargs="?", const=STEP_SIZES[-1], default=None, metavar="LARGEST",
                    help="the dynamic shape assumes every step size up to LARGEST (default 128) costs the same "
                         "(what it does where steps are free)")
    ap.add_argument("--costs", default=None, metavar="FILE[:LABEL]",
                    help="the dynamic shape takes its step costs from a measured curve (a JSON file, "
                         '{"seconds": {"1": s, "2": s, ...}}, or one LABEL of the curves.json .ci/gpu writes) instead of '
                         "the clock, and each configuration gets its "
                         "projected speed-up over greedy under that curve")
    ap.add_argument("--sweep", action="store_true", help=f"run a grid of {len(SWEEP)} configurations")
    ap.add_argument("--prompts", default=None, help='JSONL file of {"prompt": ..., "chat": true}')
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown, as docs/PERFORMANCE.md holds them")
    ap.add_argument("--compile", action="store_true", help="compile the step sizes first (model.CompiledStep)")
    ap.add_argument("--batch", type=int, default=0, metavar="B", help="compare one by one with batches of B prompts")
    ap.add_argument("--dataset", choices=["spec-bench"], default=None,
                    help="Spec-Bench's questions (data/spec_bench) instead of the built-in prompts, by category")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, metavar="N",
                    help="the model compiled with its context set to each N: K/V allocated, a step's cost at 500")
    ap.add_argument("--long", type=int, nargs="*", default=None, metavar="TOKENS",
                    help="summaries of documents of these lengths (default 500 2000 6000): prefill and decode apart")
    ap.add_argument("--max-seq-len", type=int, default=None, help="with --compile: the cache's slots (default 4096)")
    ap.add_argument("--per-category", type=int, default=2, metavar="K",
                    help="with --dataset: the first K questions of each of its 13 categories, in the file's order "
                         "(default 2); MT-Bench's 8 categories have two turns a question, so K=1 is 21 answers, K=2 42")
    ap.add_argument("--questions", type=int, nargs="+", default=None, metavar="ID",
                    help="with --dataset: these Spec-Bench question ids instead (e.g. 81 102: one answer a turn, "
                         "with --repeats 15 the paired intervals of a few answers)")
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                    help="transformers' greedy, prompt lookup and lookahead through its generate on the same "
                         "checkpoint, in the same run (default: with --dataset or --long, not with the built-in "
                         "prompts); --no-peers leaves them out")
    ap.add_argument("--warm", nargs="?", const="also", choices=("also", "only"), default=None,
                    help="with --dataset: each configuration again, with a memory kept across the questions in order "
                         "(`--warm only`: with the memory alone)")
    ap.add_argument("--answers", default=None, metavar="DIR",
                    help="with --dataset: write one answer file per decoder in Spec-Bench's format (its speed.py reads them)")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="with --dataset: draw the table (needs matplotlib)")
    ap.add_argument("--limit", type=int, default=None, metavar="N",
                    help="only the first N prompts (built-in or --prompts) or answers (--dataset): a run of minutes")
    ap.add_argument("--memory", default=None, metavar="FILE",
                    help="with --dataset and --warm: the warm decoders start from the memory saved in FILE (where it "
                         "exists), and the first one's is written there at the end (drafts.Memory)")
    ap.add_argument("--busy", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="run everything beside N processes that keep a core busy each (default 1): a shared machine")
    ap.add_argument("--control", action="store_true",
                    help="greedy decodes each prompt a second time, as one more decoder (greedy-again): its "
                         "speed-ups over greedy are this run's noise, the spread a per-prompt speed-up must leave")
    args = ap.parse_args(argv)
    if args.busy < 0:
        ap.error("--busy takes N >= 0 processes")
    if args.peers and (args.batch or args.contexts):
        ap.error("--peers goes with the built-in prompts, --prompts, --dataset or --long")
    if args.peers is None:
        args.peers = bool(args.dataset or args.long is not None)
    if (args.warm or args.answers or args.questions) and not args.dataset:
        ap.error("--warm, --answers and --questions go with --dataset spec-bench")
    if args.questions:
        try:
            spec_bench_questions(0, args.questions)
        except ValueError as e:
            ap.error(str(e))
    if args.control and (args.batch or args.contexts or args.long is not None):
        ap.error("--control goes with the built-in prompts, --prompts or --dataset")
    if args.memory and not args.warm:
        ap.error("--memory FILE goes with --dataset spec-bench --warm (the warm decoders keep a memory)")
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit takes N >= 1, got {args.limit}")
    if args.costs:
        if args.flat_cost or args.dataset or args.batch or args.long is not None:
            ap.error("--costs goes with the built-in or --prompts runs, without --flat-cost")
        try:
            load_curve(args.costs)
        except ValueError as e:
            ap.error(str(e))
    if args.batch < 0 or args.batch == 1 or (args.batch and args.compile):
        ap.error("--batch takes B >= 2, and runs uncompiled (a compiled model decodes one sequence at a time)")

    with busy_cores(args.busy):
        return run(args, argv)


@contextmanager
def busy_cores(n: int):
    """n processes that each keep a core busy (a neighbour's load) while the block runs."""
    loads = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for load in loads:
            load.kill()
            load.wait()


def run(args, argv) -> int:
    """What main does once the arguments are checked (beside --busy's load)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:  # default: the checkpoint the tests check against transformers (models/README.md)
        path = resolve_model(args.model) if args.model else build_default_model()
        model = Transformer.from_pretrained(path, device, DTYPES[args.dtype])
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.contexts:
        return bench_contexts(path, args.contexts, device, DTYPES[args.dtype])
    compile_seconds = 0.0
    if args.compile:
        start = time.perf_counter()
        model.compile_steps(STEP_SIZES, args.max_seq_len)
        compile_seconds = time.perf_counter() - start
    dtype = model.dtype
    tokenizer = Tokenizer.from_pretrained(path)
    kinds, prompts = zip(*load_prompts(args.prompts, tokenizer)[:args.limit])
    args.start_memory = None
    if args.memory:
        try:
            args.start_memory = Memory.load(args.memory, tokenizer.identity) if Path(args.memory).exists() else Memory()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    stop = tokenizer.stop_ids
    configs = [parse_config(c) for c in ["dynamic"] + SWEEP] if args.sweep else args.configs or [parse_config("dynamic")]
    configs = configs + [CONTROL] if args.control else configs
    costs = StepCosts.flat(args.flat_cost) if args.flat_cost else None
    curve = None
    if args.costs:
        curve = load_curve(args.costs)
        costs = StepCosts({size: t for size, t in curve.items() if size in STEP_SIZES})
    n_new = args.max_new_tokens

    def greedy(ids):
        return greedy_decode(model, ids, n_new, stop)

    def lookahead(ids, cfg, memory=None):  # costs: the dynamic shape's (a fixed one has none)
        if cfg == CONTROL:
            return greedy(ids)
        return generate(model, ids, n_new, stop_ids=stop, costs=costs, memory=memory, **dict(cfg.options))

    command = "python bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.dataset:
        what = (f"Spec-Bench questions {', '.join(map(str, args.questions))}" if args.questions else
                f"Spec-Bench, {args.per_category} per category")
    else:
        what = "summaries of Spec-Bench articles" if args.long is not None else f"{len(prompts)} prompts"
    print(f"{'' if args.markdown else '# '}`{command}`: {machine(device)}, {str(dtype).removeprefix('torch.')}, {what} x {n_new} "
          f"tokens, median of {args.repeats} runs"
          + (f", beside {args.busy} busy process{'es' if args.busy > 1 else ''}" if args.busy else "")
          + (f", compiled in {compile_seconds:.0f} s" if args.compile else "") + (":\n" if args.markdown else ""), flush=True)
    for ids in prompts[:2]:  # warm-up: allocator, caches, kernels
        greedy(ids), lookahead(ids, configs[0])
    if args.batch:
        return bench_batch(model, prompts, args.batch, configs, names_of(configs), greedy, lookahead, n_new, stop,
                           costs, args.repeats, args.markdown)
    if args.long is not None:
        return bench_long(model, tokenizer, path, configs, greedy, lookahead, args, device)
    if args.dataset:
        def save(names, answers):  # after every answer: an interrupted run keeps what it finished
            if args.json:
                Path(args.json).write_text(json.dumps(dict(machine=machine(device), dtype=str(dtype), max_new_tokens=n_new,
                                                           repeats=args.repeats, answers=answers), indent=1))
            if args.answers:
                write_answers(args.answers, names, answers, Path(path).name)
        names, answers = bench_spec_bench(model, tokenizer, path, configs, greedy, lookahead, args, device, save)
        # The step cost curve beside the table, timed directly (the dynamic shape only measures the
        # sizes it runs): an eager step after the answers' median context, 1 to 16 tokens.
        context = int(statistics.median(a["prompt_tokens"] for a in answers)) + n_new // 2
        seconds = step_costs_at(model, context, sizes=STEP_SIZES[:5], repeats=9)
        step_costs = (context, {size: t / seconds[1] for size, t in seconds.items()})
        categories, summary = print_spec_bench(names, answers, args.markdown, step_costs)
        labels = [f"{a['category']} {a['question_id']}" + (f" turn {a['turn']}" if a["turn"] > 1 else "") for a in answers]
        intervals = print_noise(names, [{n: a[n]["runs"] for n in names} for a in answers], labels, args.markdown)
        if args.json and intervals:
            add_to_json(args.json, intervals=intervals)
        if args.plot:
            plot_spec_bench(args.plot, names, categories, summary)
        return 0 if all(a[n]["identical"] for a in answers for n in names) else 1

    # seconds[name][repeat] summed over prompts; greedy and each config alternate on each prompt
    # so that drifts in machine speed hit all of them alike (the configs' order rotating each
    # repeat). After each prompt: a line on stderr and --json rewritten with what is finished.
    names = names_of(configs)
    labels = [f"{i + 1} {kind}" for i, kind in enumerate(kinds)]
    seconds = {name: [0.0] * args.repeats for name in names}
    per_prompt = {name: [] for name in names}  # [prompt][repeat] seconds
    results = {name: [] for name in names}
    # transformers' decoders (--peers) take their turns in the same rotation: [prompt] ->
    # (tokens, forward passes, same as our greedy), their seconds in per_prompt beside ours.
    peers = transformers_peers(path, device, dtype, n_new, stop) if args.peers else {}
    peer_results = {name: [] for name in peers}
    per_prompt.update({name: [] for name in peers})
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        for name in per_prompt:
            per_prompt[name].append([])
        for r in range(args.repeats):
            ref = timed(lambda: greedy(ids), device)
            seconds["greedy"][r] += ref.seconds
            per_prompt["greedy"][i].append(ref.seconds)
            if r == 0:
                results["greedy"].append((ref, True))
            for name, cfg in rotated(list(zip(names[1:], configs)) + [(name, None) for name in peers], r):
                if cfg is None:
                    tokens, steps, secs = peers[name](ids)
                    per_prompt[name][i].append(secs)
                    if r == 0:
                        peer_results[name].append((len(tokens), steps, tokens == ref.tokens))
                    continue
                gen = timed(lambda: lookahead(ids, cfg), device)
                seconds[name][r] += gen.seconds
                per_prompt[name][i].append(gen.seconds)
                if r == 0:
                    results[name].append((gen, gen.tokens == ref.tokens))
        rows = summary_rows(names, results, seconds, per_prompt)
        elapsed = time.perf_counter() - start
        print(f"[{i + 1}/{len(prompts)}] {labels[i]}: " + ", ".join(
            f"{r['config']} {r['prompt_speedups'][-1]:.2f}x" for r in rows[1:])
            + f"; {elapsed / 60:.1f} min, about {elapsed / (i + 1) * (len(prompts) - i - 1) / 60:.1f} min left",
            file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                machine=machine(device), dtype=str(dtype), device=str(device), max_new_tokens=n_new, repeats=args.repeats,
                prompts=labels[:i + 1], rows=rows, peers={name: dict(
                    seconds=per_prompt[name], runs=[dict(tokens=t, steps=n, identical=ok) for t, n, ok in runs])
                    for name, runs in peer_results.items()}), indent=1))
    print_tables(rows, results, labels, args.markdown)
    if peers:
        print_peers(peer_results, per_prompt, labels, args.markdown)
    intervals = print_noise(list(per_prompt), [{n: runs[i] for n, runs in per_prompt.items()} for i in range(len(labels))],
                            labels, args.markdown)
    if args.json and intervals:
        add_to_json(args.json, intervals=intervals)
    if curve:
        print_projection(rows, results, sum(g.steps for g, _ in results["greedy"]), curve, args.costs)
        if args.json:
            add_to_json(args.json, rows=rows)
    same = all(row["identical"] for row in rows) and all(ok for runs in peer_results.values() for *_, ok in runs)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
