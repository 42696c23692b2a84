"""Scanned stacks: one compiled layer looped over stacked parameters, and the checks that
the layers are alike enough for that to compute what the loop computes."""
