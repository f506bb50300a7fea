// The X-Request-Id header a client (or a proxy in front of the server) sends names its response and comes back in the
// x-request-id response header, as vLLM does. The server's own id (chatcmpl-..., cmpl-..., resp_...) still names
// the request's trace, its log line and its engine requests, so clients that reuse an id never collide. This
// remembers which requests recently sent which client id, so that GET /v1/requests/{id}/trace and the console find
// a trace by the id the client saw; bounded like the trace store.
//
// vLLM's request_id in the body names a request the same way (the header goes first where both are given, as
// vLLM takes them), so it is held to the same rules: an id a header could not carry is refused from the body too,
// else a client would get by one door an id the other refuses.

/** Longest request id taken, from the header or the body: it names the response (every chunk carries it). */
export const MAX_REQUEST_ID_LENGTH = 256;

/**
 * Why `id` cannot name a request, or undefined when it can: too long, or holding a control character other than a
 * tab, which no HTTP header value may hold (RFC 9110 5.5), so that a body's id is one a header could have sent.
 */
export function requestIdProblem(id: string): string | undefined {
  if (id.length > MAX_REQUEST_ID_LENGTH) return `a request id may be at most ${MAX_REQUEST_ID_LENGTH} characters, got ${id.length}.`;
  const control = /[\x00-\x08\x0a-\x1f\x7f]/.exec(id);
  if (control) {
    const code = `U+${control[0].charCodeAt(0).toString(16).toUpperCase().padStart(4, '0')}`;
    return `a request id may not hold control characters (${code} at position ${control.index}), as an X-Request-Id header cannot.`;
  }
  return undefined;
}

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
