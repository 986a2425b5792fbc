"""`llmtower generate "prompt"` (one completion, streamed to stdout) and `llmtower chat`
(an interactive chat in the terminal), both on an in-process engine (the offline ``LLM``)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterable

from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs

CHAT_HELP = "/exit or Ctrl-D: quit; /reset: forget the conversation; Ctrl-C: stop a reply"


def register(sub) -> None:
    g = sub.add_parser("generate", help="complete one prompt and print the completion",
                       description="Complete one prompt with a model running in this process; "
                       "the completion is streamed to stdout, statistics go to stderr.")
    g.add_argument("prompt", nargs="?", default="-",
                   help="the prompt ('-' or nothing: read it from stdin)")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    _add_sampling_args(g)
    EngineArgs.add_cli_args(g, skip=("seed",))
    g.set_defaults(handler=run_generate)

    c = sub.add_parser("chat", help="chat with a model in the terminal",
                       description=f"Interactive chat; the conversation is kept. {CHAT_HELP}.")
    c.add_argument("--system", default=None, help="system message starting the conversation")
    _add_sampling_args(c)
    EngineArgs.add_cli_args(c, skip=("seed",))
    c.set_defaults(handler=run_chat)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    s.add_argument("--temperature", type=float, default=0.7,
                   help="0 for greedy decoding (default: 0.7)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0, off)")
    s.add_argument("--top-k", type=int, default=0, help="top-k sampling (default: 0, off)")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the top token's probability "
                   "(default: 0, off)")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already seen by this (> 1 repeats less; "
                   "default: 1, off)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                   help="Jinja chat template (a file, or the template itself) instead of the "
                   "tokenizer's")
    s.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for reproducible output (default: none)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text is generated (repeatable)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="keep generating after the end-of-sequence token (up to --max-tokens)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          stop=args.stop, ignore_eos=args.ignore_eos)


def _chat_template(args: argparse.Namespace) -> str | None:
    from llmtower.engine.input_processor import resolve_chat_template
    return resolve_chat_template(args.chat_template)


def _make_llm(args: argparse.Namespace):
    from llmtower.engine.llm import LLM  # pulls in torch and the model code

    # --seed is the sampling seed; it also seeds the engine when given.
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
              if f.name != "seed" and hasattr(args, f.name)}
    if args.seed is not None:
        kwargs["seed"] = args.seed
    return LLM(**kwargs)


def _print_stream(outputs: Iterable) -> tuple[str, int, str | None]:
    """Write each new piece of text as it comes; return the text, its number of tokens and
    the finish reason."""
    parts: list[str] = []
    num_tokens, finish_reason = 0, None
    for ro in outputs:
        for c in ro.outputs:
            sys.stdout.write(c.text)
            sys.stdout.flush()
            parts.append(c.text)
            num_tokens += len(c.token_ids)
            finish_reason = c.finish_reason or finish_reason
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts), num_tokens, finish_reason


def run_generate(args: argparse.Namespace) -> int:
    # A piped prompt ends with the newline of its last line, which is not part of it.
    prompt = sys.stdin.read().removesuffix("\n") if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError("the prompt is empty: pass it as an argument or on stdin")
    sp = _sampling_params(args)
    llm = _make_llm(args)
    t0 = time.perf_counter()
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        stream = llm.stream_chat(messages + [{"role": "user", "content": prompt}], sp,
                                 chat_template=_chat_template(args))
    else:
        stream = llm.stream(prompt, sp)
    _, num_tokens, finish_reason = _print_stream(stream)
    dt = time.perf_counter() - t0
    print(f"[{num_tokens} tokens in {dt:.2f} s, {num_tokens / max(dt, 1e-9):.1f} tokens/s, "
          f"finish_reason={finish_reason}]", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from llmtower.core.errors import AdmissionError

    sp = _sampling_params(args)
    llm = _make_llm(args)
    template = _chat_template(args)
    if template is None and not getattr(llm.get_tokenizer(), "chat_template", None):
        raise ValueError(f"model {args.model!r} has no chat template: pass --chat-template "
                         "FILE, or use `llmtower generate`")
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    print(f"Chatting with {args.model}. {CHAT_HELP}.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        message = line.strip()
        if not message:
            continue
        if message in ("/exit", "/quit"):
            break
        if message == "/reset":
            history = list(start)
            print("(conversation cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": message})
        try:
            reply, _, _ = _print_stream(llm.stream_chat(history, sp, chat_template=template))
        except KeyboardInterrupt:
            print("\n(reply stopped)", file=sys.stderr)
            history.pop()
            continue
        except AdmissionError as e:
            print(f"error: {e}\n(the conversation is too long for the model: /reset to start "
                  "over)", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
    return 0
