"""Generated protobuf messages for ClusterD's Recover service (see proto/ and scripts/gen_proto.py)."""
