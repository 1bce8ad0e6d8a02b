"""`jaxlight generate PATH --prompt TEXT`: sample from a Hugging Face model directory."""

from __future__ import annotations

from collections.abc import Sequence

from jaxlight._cli._build import build_strategy
from jaxlight._cli._devices import parse_command
from jaxlight._cli._help import COMMANDS
from jaxlight._cli._options import Parser
from jaxlight._errors import ConfigurationError
from jaxlight.nn.pretrained import Tokenizer, from_pretrained, generate


def generate_command(argv: Sequence[str]) -> list[str]:
    """Parses `argv`, loads the model into the strategy's layout, prints and returns each
    prompt's continuation."""
    parser = Parser(prog="jaxlight generate", description=COMMANDS["generate"],
                    allow_abbrev=False)
    parser.add_argument("path", help="a Hugging Face model directory (config.json, "
                        "*.safetensors, tokenizer.json)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeat for a batch)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 decodes greedily (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="0: off (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    parser.add_argument("--dtype", default=None,
                        help="parameter dtype, e.g. float32 (default: the checkpoint's)")
    parser.add_argument("--strategy", default=None,
                        help="(default: single, or hybrid with --mesh-shape)")
    parser.add_argument("--mesh-shape", default=None,
                        help="mesh for strategies.Hybrid, e.g. '[[4,2],[\"fsdp\",\"tp\"]]'")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulate this many CPU devices (default: as XLA_FLAGS says)")
    args = parse_command(parser, argv)
    strategy = build_strategy(args.strategy or ("hybrid" if args.mesh_shape else "single"),
                              args.mesh_shape)
    if not hasattr(strategy, "spec_for"):
        raise ConfigurationError(f"jaxlight generate runs SPMD strategies (single, dp, fsdp, tp, "
                                 f"hybrid), not {args.strategy!r}.")
    strategy.setup()
    tokenizer = Tokenizer(args.path)
    model = from_pretrained(args.path, strategy, param_dtype=args.dtype)
    if args.chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True)
                   for p in args.prompt]
    else:
        prompts = [tokenizer.encode(p) for p in args.prompt]
    stop = [t for t in {*(model.config.token_ids.get("eos") or []), tokenizer.eos_id}
            if t is not None]
    out = generate(model, prompts, args.max_new_tokens, strategy=strategy,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, stop_tokens=sorted(stop), pad_id=tokenizer.pad_id)
    texts = [tokenizer.decode(ids) for ids in out]
    for prompt, text in zip(args.prompt, texts, strict=True):
        print(f"{prompt}{text}" if not args.chat else f"user: {prompt}\nassistant: {text}")
    return texts
