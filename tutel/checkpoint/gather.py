"""Merges the per-rank checkpoint files of N processes into one (all experts in one file).

    python3 -m tutel.checkpoint.gather --inputs=ckpt/model-{rank}-of-{size}.pt --input_size=N \\
        --output=ckpt/model-all.pt [--namespace=model] [--default_num_global_experts=K]

Every global expert must be in exactly one file (shared experts: every slice once); the
parameters outside the experts should be equal in all files (rank 0's are written, with a
warning naming any that differ).  The output loads with ``load_state_dict`` on any number of
processes and is the input of ``tutel.checkpoint.scatter``.
"""
import argparse
from typing import List, Optional

from .files import command_line_parser, rank_files, read_states, run_command_line, with_inner_state, write_file
from .reshard import gather_state_dicts


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = command_line_parser(__doc__, "tutel.checkpoint.gather", [
        ("--inputs", str, "file pattern with {rank} (and {size})"),
        ("--input_size", int, "number of per-rank files (processes)"),
        ("--output", str, "the merged checkpoint to write")])
    parser.add_argument("--default_num_global_experts", type=int, default=None,
                        help="expert count of legacy checkpoints without `_num_global_experts`")
    return parser.parse_args(argv)


def gather_files(args: argparse.Namespace) -> None:
    """Reads the per-rank files, merges them and writes the output file."""
    files = rank_files(args.inputs, args.input_size, "--inputs")
    states, first_content = read_states(files, args.namespace, args.trust_pickle)
    merged = gather_state_dicts(states, labels=files, default_num_global_experts=args.default_num_global_experts)
    write_file(with_inner_state(first_content, args.namespace, merged), args.output)
    print(f"Model params have been collected to: {args.output}")


def main(argv: Optional[List[str]] = None) -> None:
    run_command_line("tutel.checkpoint.gather", lambda: gather_files(parse_args(argv)))


if __name__ == "__main__":
    main()
