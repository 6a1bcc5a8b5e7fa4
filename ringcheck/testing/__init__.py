"""The installable test kit: Hypothesis strategies, property bodies parametrised by the
implementation, the pytest plugin, the public mutant catalogue and bad implementations."""
