// The X-Request-Id header a client (or a proxy in front of the server) sends names its response and comes back in the
// x-request-id response header, as vLLM does. The server's own id (chatcmpl-..., cmpl-..., resp_...) still names
// the request's trace, its log line and its engine requests, so clients that reuse an id never collide. This
// remembers which requests recently sent which client id, so that GET /v1/requests/{id}/trace and the console find
// a trace by the id the client saw; bounded like the trace store.

export class ClientRequestIds {
  /** Server ids of the requests that sent each client id, oldest first. */
  private readonly byClientId = new Map<string, string[]>();
  /** Every pair remembered, oldest first from `head`: what to forget first. */
  private order: { clientId: string; serverId: string }[] = [];
  private head = 0;

  constructor(readonly capacity: number) {}

  add(clientId: string, serverId: string): void {
    const ids = this.byClientId.get(clientId);
    if (ids) ids.push(serverId);
    else this.byClientId.set(clientId, [serverId]);
    this.order.push({ clientId, serverId });
    while (this.order.length - this.head > this.capacity) {
      // The oldest pair overall is the oldest of its own client id.
      const oldest = this.order[this.head++]!;
      const list = this.byClientId.get(oldest.clientId)!;
      list.shift();
      if (list.length === 0) this.byClientId.delete(oldest.clientId);
    }
    if (this.head >= this.capacity) {
      this.order = this.order.slice(this.head);
      this.head = 0;
    }
  }

  /** The server ids of the remembered requests that sent `clientId`, newest first. */
  serverIds(clientId: string): string[] {
    return [...(this.byClientId.get(clientId) ?? [])].reverse();
  }
}
