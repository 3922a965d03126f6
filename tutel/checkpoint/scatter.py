"""Splits a merged checkpoint (all experts in one file) into the files of N processes.

    python3 -m tutel.checkpoint.scatter --input=ckpt/model-all.pt --output_size=N \\
        --outputs=ckpt/model-{rank}-of-{size}.pt [--namespace=model]

N may be any divisor of the expert count (whole experts per process) or any multiple of it
(processes sharing experts: ffn weights are cut along the hidden dim, which must divide
evenly; fc2 biases and flat llama_ffn weights are zero-padded as the layer pads them).
"""
import argparse
from typing import List, Optional

from .files import command_line_parser, inner_state, rank_files, read_file, run_command_line, with_inner_state, write_file
from .reshard import scatter_state_dict


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return command_line_parser(__doc__, "tutel.checkpoint.scatter", [
        ("--input", str, "the merged checkpoint"),
        ("--output_size", int, "number of processes to write files for"),
        ("--outputs", str, "file pattern with {rank} (and {size})")]).parse_args(argv)


def scatter_file(args: argparse.Namespace) -> None:
    """Reads the merged file and writes one file per process."""
    content = read_file(args.input, args.trust_pickle)
    states = scatter_state_dict(inner_state(content, args.namespace, args.input), args.output_size)
    for path, state in zip(rank_files(args.outputs, args.output_size, "--outputs"), states):
        write_file(with_inner_state(content, args.namespace, state), path)
        print(f"Model params have been scattered to: {path}")


def main(argv: Optional[List[str]] = None) -> None:
    run_command_line("tutel.checkpoint.scatter", lambda: scatter_file(parse_args(argv)))


if __name__ == "__main__":
    main()
