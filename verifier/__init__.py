"""The verifier: the target model (model/), decoding (decode/) and the gRPC server (service/)."""
