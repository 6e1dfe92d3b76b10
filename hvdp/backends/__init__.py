"""One module per framework (torch.py, tensorflow.py), each a ``Backend`` of the contract in base.py."""
