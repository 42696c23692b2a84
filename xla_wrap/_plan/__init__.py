"""Planning: measure each block's choices, model the step's peak, solve for a budget."""
