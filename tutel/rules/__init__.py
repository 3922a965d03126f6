"""The rules every other part of tutel follows, at the bottom of the package's layers.

Plain functions of shapes, counts and flags that several layers must apply identically: the
capacity rule and its alignment (capacity.py), which process holds which expert (placement.py),
autocast queries (autocast.py), which path runs a call (paths.py) and the size lines between
implementations (lines.py).  They import nothing of tutel, so any layer may use them
(docs/design.md, "Layers of the code").
"""
