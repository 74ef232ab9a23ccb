"""What every interface shares: the model host, settings, the remote endpoint."""
