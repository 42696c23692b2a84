"""The ground floor: errors, argument trees, warnings, `XLA_FLAGS` and the package's mutable
state. Imports nothing of xla_wrap outside it."""
