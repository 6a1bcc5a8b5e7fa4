"""Judging: a case's inputs (distributions), its references, per-tensor metrics and the
verdict (budget policy); `check` turns a case into a verdict."""
