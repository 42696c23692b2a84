"""The torch.compile gateway: the only place that reaches Dynamo, AOTAutograd and
`torch.utils.checkpoint`."""
