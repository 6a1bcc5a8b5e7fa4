pytest_plugins = ["ringcheck.testing.plugin", "ringcheck.testing.suite_defaults"]
