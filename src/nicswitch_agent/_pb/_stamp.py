"""Which .proto the committed gencode was made from (checked by tests/test_proto.py)."""

PROTO_SHA256 = "5b1c7c82937cf21c7e049b256e093cc68921d5845eebb9f8199bc90b3d334285"
GENERATOR = "grpcio-tools==1.62.3"
