"""Makes a fairseq checkout (commit b5e7b25) use tutel MoE layers in its Transformer decoder.

    python3 examples/fairseq_moe/apply_patch.py /path/to/fairseq

1. copies tutel_moe.py to fairseq/modules/tutel_moe.py;
2. fairseq/models/transformer.py, TransformerDecoder.__init__: after the decoder layers are
   built (the ``self.layers.extend(...)`` statement), ``install_tutel_moe(self.layers)``;
3. fairseq/criterions/cross_entropy.py, forward: after ``compute_loss``,
   ``loss = add_l_aux(loss, sample["ntokens"])``;
4. fairseq/optim/fp16_optimizer.py, clip_grad_norm: after the fp16 gradients are copied to
   fp32, ``zero_non_finite_grads(self.fp32_params)`` (acts only with NO_OVERFLOW=1).

Each edit is anchored on a statement and checked; an edited file is marked, so running the
script again changes nothing; a missing anchor stops the script before any file is written.
"""
import os
import re
import shutil
import sys
from typing import List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "# tutel-moe"

# (file, class or None, regex of the anchor statement's first line, code inserted after the statement, import)
EDITS: List[Tuple[str, str, str, str, str]] = [
    ("fairseq/models/transformer.py", "class TransformerDecoder(", r"^(\s*)self\.layers\.extend\(",
     "install_tutel_moe(self.layers)", "from fairseq.modules.tutel_moe import install_tutel_moe"),
    ("fairseq/criterions/cross_entropy.py", None, r"^(\s*)loss, _ = self\.compute_loss\(",
     'loss = add_l_aux(loss, sample["ntokens"])', "from fairseq.modules.tutel_moe import add_l_aux"),
    ("fairseq/optim/fp16_optimizer.py", None, r"^(\s*)self\._sync_fp16_grads_to_fp32\(\)",
     "zero_non_finite_grads(self.fp32_params)", "from fairseq.modules.tutel_moe import zero_non_finite_grads"),
]


def _statement_end(lines: List[str], start: int) -> int:
    """Index of the last line of the statement starting at `start` (balanced brackets)."""
    depth = 0
    for index in range(start, len(lines)):
        code = lines[index].split("#", 1)[0]
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0:
            return index
    raise ValueError(f"unbalanced brackets after line {start + 1}")


def edit_source(text: str, within: str, anchor: str, code: str, import_line: str, path: str) -> str:
    """`text` with `code` inserted after the anchor statement (inside class `within`, if given)."""
    if MARK in text:
        return text
    lines = text.split("\n")
    first = 0
    if within is not None:
        found = [i for i, line in enumerate(lines) if line.startswith(within)]
        if not found:
            raise ValueError(f"{path}: `{within}` not found: is this fairseq at commit b5e7b25?")
        first = found[0]
    pattern = re.compile(anchor)
    match = next(((i, pattern.match(lines[i])) for i in range(first, len(lines)) if pattern.match(lines[i])), None)
    if match is None:
        raise ValueError(f"{path}: no line matching {anchor!r}: is this fairseq at commit b5e7b25?")
    index, found = match
    end = _statement_end(lines, index)
    lines.insert(end + 1, f"{found.group(1)}{code}  {MARK}")
    first_import = next(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    lines.insert(_statement_end(lines, first_import) + 1, f"{import_line}  {MARK}")
    return "\n".join(lines)


def apply(root: str) -> List[str]:
    """Edits the checkout at `root`; returns the files changed."""
    planned = []
    for relative, within, anchor, code, import_line in EDITS:
        path = os.path.join(root, relative)
        if not os.path.exists(path):
            raise ValueError(f"{path} does not exist: give the root of a fairseq checkout")
        with open(path) as handle:
            original = handle.read()
        planned.append((path, original, edit_source(original, within, anchor, code, import_line, path)))
    changed = []
    for path, original, edited in planned:
        if edited != original:
            with open(path, "w") as handle:
                handle.write(edited)
            changed.append(path)
    target = os.path.join(root, "fairseq", "modules", "tutel_moe.py")
    shutil.copyfile(os.path.join(HERE, "tutel_moe.py"), target)
    return changed + [target]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python3 apply_patch.py /path/to/fairseq")
    try:
        for path in apply(argv[0]):
            print(f"patched {path}")
    except ValueError as error:
        sys.exit(f"apply_patch.py: {error}")


if __name__ == "__main__":
    main()
