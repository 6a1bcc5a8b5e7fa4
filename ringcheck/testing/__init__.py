"""The installable test kit: Hypothesis strategies, property bodies parametrised by the
implementation, the pytest plugin and its options. The rings it tests against (the public
mutants, the bad implementations, the textbook rings) are in `ringcheck.catalogue`."""
