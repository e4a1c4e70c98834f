"""Sans-IO wire protocol: messages, framing, tensor and top-K codecs."""
