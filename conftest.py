"""Root pytest configuration: options and fixtures shared by the suites."""
