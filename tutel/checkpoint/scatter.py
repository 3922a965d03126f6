"""Splits a merged checkpoint (all experts in one file) into the files of N processes.

    python3 -m tutel.checkpoint.scatter --input=ckpt/model-all.pt --output_size=N \\
        --outputs=ckpt/model-{rank}-of-{size}.pt [--namespace=model]

N may be any divisor of the expert count (whole experts per process) or any multiple of it
(processes sharing experts: ffn weights are cut along the hidden dim, which must divide
evenly; fc2 biases and flat llama_ffn weights are zero-padded as the layer pads them).
"""
import argparse
import logging
import sys
from typing import List, Optional

from .files import inner_state, rank_files, read_file, with_inner_state, write_file
from .reshard import scatter_state_dict


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m tutel.checkpoint.scatter", description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=str, required=True, help="the merged checkpoint")
    parser.add_argument("--output_size", type=int, required=True, help="number of processes to write files for")
    parser.add_argument("--outputs", type=str, required=True, help="file pattern with {rank} (and {size})")
    parser.add_argument("--namespace", type=str, default="",
                        help="where the state dict sits in the file, e.g. model or a/b")
    parser.add_argument("--trust_pickle", action="store_true",
                        help="allow any pickled object in the file (only for files you trust)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(format="%(levelname)s: %(message)s")
    args = parse_args(argv)
    try:
        files = rank_files(args.outputs, args.output_size, "--outputs")
        content = read_file(args.input, args.trust_pickle)
        states = scatter_state_dict(inner_state(content, args.namespace, args.input), args.output_size)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"tutel.checkpoint.scatter: error: {error}")
    for path, state in zip(files, states):
        write_file(with_inner_state(content, args.namespace, state), path)
        print(f"Model params have been scattered to: {path}")


if __name__ == "__main__":
    main()
