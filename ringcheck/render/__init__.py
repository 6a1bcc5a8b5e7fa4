"""Presentation of the documents the commands build (`ringcheck.documents`): the only layer
that imports rich (`terminal`) and matplotlib (`plots`, when a figure is drawn).

- `terminal`: the console, validate's verdict table, the progress display, drift's summary and
  diff, bench's tables;
- `drift_content`: what a drift report says in every format (readings of the document and
  the report as content blocks);
- `markdown`: validate.md and drift.md;
- `html`: drift.html and validate.html, with their plots embedded;
- `plots`: the drift figures and validate's error-over-budget plot, as PNG bytes;
- `train_content`, `train_report`, `train_plots`, `train_terminal`: `ringcheck train`'s report
  (what it says, its Markdown and HTML, its figures, its terminal summary);
- `files`: the report folders a command writes (the JSON through `documents.save`, the
  Markdown and HTML beside it).
"""
