"""The commands behind the CLI: validate, drift, bench, and the adapters that bring other
rings under the `--impl` contract."""
