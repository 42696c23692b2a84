"""Reading what XLA made of a step: HLO text, buffer assignments, saved residuals."""
