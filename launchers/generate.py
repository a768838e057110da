"""Continue a prompt with a trained model, or score texts, from an export folder.

    python launchers/generate.py exports/ptb_small --prompt "the company said" --max-new-tokens 40 --seed 1
    python launchers/generate.py exports/ptb_small --prompt "the company said" --greedy
    python launchers/generate.py exports/lm1b_base --prompt "The" --top-p 0.9 --temperature 0.8 --mem-len 256
    python launchers/generate.py exports/ptb_small --score "the market fell" "fell the market"
    python launchers/generate.py exports/enwik8_base --prompt "[[Albert Einstein]] was" --max-new-tokens 200
    python launchers/generate.py exports/enwik8_base --score "The cat sat." "Cat the sat."   # bits per character

Decoding is incremental: after the prompt, one forward of one token per new token, each layer's keys and values
of the context (at most --mem-len positions, the model's by default) kept in a cache. Text is printed as it is
generated. Prompts and scored texts with unknown words get a warning: the unknown token is often likely, so such a
text can score better than real text. The export's files are checked against its checksums.json first
(--no-verify skips that, and says so).
"""

from __future__ import annotations

import argparse
import sys

from txl_dist.exit_status import run_command
from txl_dist.supervision.interrupts import one_line_on_stop


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launchers/generate.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("export", help="an export folder (launchers/convert.py zero-to-export)")
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--prompt", help="text to continue")
    task.add_argument("--score", nargs="+", metavar="TEXT", help="texts to score (log-probability, perplexity)")
    parser.add_argument("--max-new-tokens", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    parser.add_argument("--greedy", action="store_true", help="always the most probable token")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--mem-len", type=int, help="memory length (default: the model's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--no-verify", action="store_true", help="read the export without checking its files against its checksums.json"
    )
    return parser


@one_line_on_stop("generate.py", "what it generated or scored before is printed above")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # lazy: --help stays under 1 s (torch takes seconds to import)
    from txl_dist.downstream.generate import generate_or_score

    return generate_or_score(args)


if __name__ == "__main__":
    sys.exit(run_command(main, "generate.py"))
