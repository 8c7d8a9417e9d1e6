"""What both sides of a prefill/decode link share: settings, the wire format, the
transport (a private process group per pair), the authenticated handshake, staging
buffers and transfer observability."""
