"""Merges the per-rank checkpoint files of N processes into one (all experts in one file).

    python3 -m tutel.checkpoint.gather --inputs=ckpt/model-{rank}-of-{size}.pt --input_size=N \\
        --output=ckpt/model-all.pt [--namespace=model] [--default_num_global_experts=K]

Every global expert must be in exactly one file (shared experts: every slice once); the
parameters outside the experts should be equal in all files (rank 0's are written, with a
warning naming any that differ).  The output loads with ``load_state_dict`` on any number of
processes and is the input of ``tutel.checkpoint.scatter``.
"""
import argparse
import logging
import sys
from typing import List, Optional

from .files import rank_files, read_states, with_inner_state, write_file
from .reshard import gather_state_dicts


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m tutel.checkpoint.gather", description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=str, required=True, help="file pattern with {rank} (and {size})")
    parser.add_argument("--input_size", type=int, required=True, help="number of per-rank files (processes)")
    parser.add_argument("--output", type=str, required=True, help="the merged checkpoint to write")
    parser.add_argument("--namespace", type=str, default="",
                        help="where the state dict sits in each file, e.g. model or a/b")
    parser.add_argument("--default_num_global_experts", type=int, default=None,
                        help="expert count of legacy checkpoints without `_num_global_experts`")
    parser.add_argument("--trust_pickle", action="store_true",
                        help="allow any pickled object in the files (only for files you trust)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(format="%(levelname)s: %(message)s")
    args = parse_args(argv)
    try:
        files = rank_files(args.inputs, args.input_size, "--inputs")
        states, first_content = read_states(files, args.namespace, args.trust_pickle)
        merged = gather_state_dicts(states, labels=files, default_num_global_experts=args.default_num_global_experts)
        write_file(with_inner_state(first_content, args.namespace, merged), args.output)
    except ValueError as error:
        sys.exit(f"tutel.checkpoint.gather: error: {error}")
    print(f"Model params have been collected to: {args.output}")


if __name__ == "__main__":
    main()
