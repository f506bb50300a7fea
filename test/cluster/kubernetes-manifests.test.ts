// deploy/kubernetes/*.yaml: every object parses (yaml) and validates against the Kubernetes API's OpenAPI schemas
// (the `kubernetes-models` package: each class's validate()), and the manifests wire the runtime the way the code
// expects: the frontend probes /health and /live, workers and frontend find etcd and NATS through the services and take
// the cluster token from the secret, workers advertise their pod IP and get more time to stop than they drain.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseAllDocuments } from 'yaml';
import { Deployment } from 'kubernetes-models/apps/v1/Deployment';
import { StatefulSet } from 'kubernetes-models/apps/v1/StatefulSet';
import { Service } from 'kubernetes-models/v1/Service';

const dir = fileURLToPath(new URL('../../deploy/kubernetes/', import.meta.url));
const MODELS: Record<string, new (data: never) => { validate(): void }> = {
  'apps/v1/Deployment': Deployment as never, 'apps/v1/StatefulSet': StatefulSet as never, 'v1/Service': Service as never,
};

type Obj = { apiVersion: string; kind: string; metadata: { name: string }; spec: Record<string, any> };

function objects(): Obj[] {
  return readdirSync(dir).filter((f) => f.endsWith('.yaml')).flatMap((file) =>
    parseAllDocuments(readFileSync(join(dir, file), 'utf8')).map((doc) => {
      assert.equal(doc.errors.length, 0, `${file}: ${doc.errors.join('; ')}`);
      return doc.toJS() as Obj;
    }));
}

describe('Kubernetes manifests', () => {
  test('every object validates against the Kubernetes API schema', () => {
    const all = objects();
    assert.ok(all.length >= 7);
    for (const object of all) {
      const Model = MODELS[`${object.apiVersion}/${object.kind}`];
      assert.ok(Model, `${object.kind} ${object.metadata.name}: a kind the test knows`);
      assert.doesNotThrow(() => new Model(object as never).validate(), `${object.kind} ${object.metadata.name}`);
    }
    // The check can fail: a wrong type is refused.
    const broken = structuredClone(all.find((o) => o.kind === 'Deployment')!);
    broken.spec.replicas = 'two';
    assert.throws(() => new Deployment(broken as never).validate());
  });

  test('the frontend probes /health and /live; workers and frontend reach etcd, NATS and the token', () => {
    const all = objects();
    const deployment = (name: string) => all.find((o) => o.kind === 'Deployment' && o.metadata.name === name)!;
    const container = (name: string) => deployment(name).spec.template.spec.containers[0];
    const frontend = container('conduit-frontend');
    assert.equal(frontend.readinessProbe.httpGet.path, '/health');
    assert.equal(frontend.livenessProbe.httpGet.path, '/live');
    const services = new Set(all.filter((o) => o.kind === 'Service').map((o) => o.metadata.name));
    for (const name of ['conduit-frontend', 'conduit-worker']) {
      const env = new Map<string, any>(container(name).env.map((e: any) => [e.name, e]));
      assert.match(env.get('CONDUIT_ETCD_ENDPOINTS').value, /^http:\/\/conduit-etcd:2379$/);
      assert.match(env.get('CONDUIT_NATS_SERVER').value, /^nats:\/\/conduit-nats:4222$/);
      assert.equal(env.get('CONDUIT_CLUSTER_TOKEN').valueFrom.secretKeyRef.name, 'conduit-cluster');
      assert.ok(services.has('conduit-etcd') && services.has('conduit-nats'));
    }
    const worker = container('conduit-worker');
    assert.ok(worker.args.includes('--advertise-address=$(POD_IP):7000'));
    const grace = Number(/--shutdown-grace=(\d+)/.exec(worker.args.join(' '))![1]);
    assert.ok(deployment('conduit-worker').spec.template.spec.terminationGracePeriodSeconds > grace, 'the pod outlives the drain');
    // A worker's port opens only once its model is loaded: a startup probe holds liveness off for minutes of loading.
    assert.equal(worker.startupProbe.tcpSocket.port, 7000);
    assert.ok(worker.startupProbe.periodSeconds * worker.startupProbe.failureThreshold >= 300, 'at least 5 minutes to load a model');
    // etcd's peer URL names its pod through the StatefulSet's governing Service, which must be headless to resolve.
    const etcd = all.find((o) => o.kind === 'StatefulSet' && o.metadata.name === 'conduit-etcd')!;
    const governing = all.find((o) => o.kind === 'Service' && o.metadata.name === etcd.spec.serviceName)!;
    assert.equal(governing.spec.clusterIP, 'None');
  });
});
