// distgrad's port hub: a SharedWorker, one per browser profile and origin, that gives two tabs of
// this browser a MessageChannel between them. A tab posts {pair, rank} once per peer it found on
// the pair's BroadcastChannel; when the other rank of the pair asks too, each gets one end of a new
// channel (a direct pipe between the two tabs, no broadcast in between). Pair names carry the
// room's token, as the BroadcastChannels' do, and both tabs' session ids (new at every join), so a
// request an earlier session of the room left here never matches a later one.
const waiting = new Map(); // pair name -> { rank, port } of the tab that asked first
const MAX_WAITING = 4096; // requests whose peer never asked (it fell back) are dropped oldest first

onconnect = (e) => {
  const port = e.ports[0];
  port.onmessage = (m) => {
    const { pair, rank } = m.data ?? {};
    if (typeof pair !== 'string' || !Number.isInteger(rank)) return;
    const first = waiting.get(pair);
    if (first && first.rank !== rank) {
      waiting.delete(pair);
      const ch = new MessageChannel();
      first.port.postMessage({ pair }, [ch.port1]);
      port.postMessage({ pair }, [ch.port2]);
      return;
    }
    waiting.delete(pair); // a repeated request goes to the back of the eviction order
    waiting.set(pair, { rank, port });
    if (waiting.size > MAX_WAITING) waiting.delete(waiting.keys().next().value);
  };
};
