"""The ClusterD side of the leader: channels, the notify and process-manage streams, reports, the
reply, and how RPC errors are read and retried. The only package of the client that imports gRPC;
members (every rank but the leader) never import it."""
