"""The gRPC API layer: servicers and the conversions between protobuf messages and numpy."""
