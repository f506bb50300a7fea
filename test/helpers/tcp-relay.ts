// A TCP relay on 127.0.0.1 in front of a worker's request endpoint, for the cluster tests: the address a worker
// advertises stays the relay's while the process behind it changes (`target`, read at each new connection), the
// test can cut every relayed connection (a network blip), and it can hold what a frontend sends after the worker's
// welcome (on the request plane that is the model-card request the frontend makes before it joins the worker) until
// released, so two joins can be made to overlap without sleeping. It can also split what the worker sends into its
// frames and pause after each frame of one type, so the frontend reads that frame well before the ones that follow.
import net from 'node:net';
import { FRAME_HEADER_BYTES, FRAME_JSON, FrameReader, parseJsonMessage } from '../../src/cluster/frames.ts';

export interface TcpRelay {
  address: string;
  /** The port new connections are relayed to. */
  target: number;
  /** Connections relayed so far. */
  readonly accepted: number;
  /** Bytes a frontend sent after the welcome that are being held (0 when none, or when not holding). */
  readonly heldBytes: number;
  /** Holds (true) or passes on (false) what frontends send after the welcome; releasing sends what was held. */
  hold(on: boolean): void;
  /** Cuts every relayed connection. */
  cut(): void;
  close(): Promise<void>;
}

export interface TcpRelayOptions {
  /** The worker's frames go on one at a time, and those after a JSON frame of this type (`t`) only `ms` later. */
  pauseAfterWorkerFrame?: { type: string; ms: number };
}

export async function startTcpRelay(target: number, options: TcpRelayOptions = {}): Promise<TcpRelay> {
  const sockets = new Set<net.Socket>();
  /** Per connection: the upstream socket, whether the worker has answered yet, and what waits to be sent. */
  const links = new Set<{ upstream: net.Socket; welcomed: boolean; held: Buffer[] }>();
  let holding = false;
  let accepted = 0;
  const server = net.createServer((downstream) => {
    accepted++;
    const upstream = net.connect({ host: '127.0.0.1', port: relay.target });
    const link = { upstream, welcomed: false, held: [] as Buffer[] };
    links.add(link);
    for (const socket of [downstream, upstream]) {
      sockets.add(socket);
      socket.on('error', () => {});
      socket.on('close', () => {
        sockets.delete(socket);
        links.delete(link);
        downstream.destroy();
        upstream.destroy();
      });
    }
    // The frontend's hello goes before any byte of the worker's; what follows the welcome can be held.
    downstream.on('data', (chunk: Buffer) => {
      if (holding && link.welcomed) link.held.push(chunk);
      else upstream.write(chunk);
    });
    const pause = options.pauseAfterWorkerFrame;
    const frames = new FrameReader();
    let sent = Promise.resolve();
    upstream.on('data', (chunk: Buffer) => {
      link.welcomed = true;
      if (!pause) return void downstream.write(chunk);
      for (const { kind, payload } of frames.push(chunk)) {
        const header = Buffer.alloc(FRAME_HEADER_BYTES);
        header.writeUInt32BE(payload.length + 1, 0);
        header[4] = kind;
        const paused = kind === FRAME_JSON && parseJsonMessage(payload).t === pause.type;
        sent = sent.then(async () => {
          downstream.write(Buffer.concat([header, payload]));
          if (paused) await new Promise((resolve) => setTimeout(resolve, pause.ms));
        });
      }
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const port = (server.address() as net.AddressInfo).port;
  const relay: TcpRelay = {
    address: `127.0.0.1:${port}`,
    target,
    get accepted() { return accepted; },
    get heldBytes() {
      let bytes = 0;
      for (const link of links) for (const chunk of link.held) bytes += chunk.length;
      return bytes;
    },
    hold(on: boolean) {
      holding = on;
      if (on) return;
      for (const link of links) for (const chunk of link.held.splice(0)) link.upstream.write(chunk);
    },
    cut() {
      for (const socket of sockets) socket.destroy();
    },
    close: () => {
      for (const socket of sockets) socket.destroy();
      return new Promise((resolve) => server.close(() => resolve()));
    },
  };
  return relay;
}
