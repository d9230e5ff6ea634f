"""nip_like."""
