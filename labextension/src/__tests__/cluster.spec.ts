import {
  ageText,
  clusterView,
  historySummary,
  parseCluster,
  parseClusterHistory,
  windowText
} from '../clustermodel';
import { ITrans, noTranslation } from '../model';

const GiB = 1024 ** 3;
const MiB = 1024 ** 2;

/** A `GET cluster?min_free=10G` answer as tests/cluster/test_prometheus.py's Prometheus gives it. */
const answer = {
  configured: true,
  prometheus_url: 'http://127.0.0.1:9090',
  timestamp_s: 1718000010,
  constraints: { min_free: '10G' },
  constraints_text: 'min free 10.0 GiB',
  best: 'gpu-b',
  errors: [],
  hosts: [
    {
      hostname: 'dgx-d',
      instances: ['127.0.0.5:9400'],
      state: 'ok',
      as_of_s: 1718000009,
      scrape_interval_s: 1,
      note: null,
      devices: [
        {
          uuid: 'GPU-dddd0001/1',
          index: 1,
          mig_index: 1,
          label: 'GPU 1 MIG 1',
          name: 'NVIDIA A100-SXM4-80GB',
          available: true,
          source: 'dcgm',
          utilization_pct: 50,
          memory_used_bytes: 1000 * MiB,
          memory_total_bytes: 40000 * MiB,
          memory_free_bytes: 39000 * MiB,
          memory_booked_bytes: 0,
          temperature_c: null,
          power_w: null,
          lease_count: 0,
          waiters: 0,
          holders: []
        }
      ]
    },
    {
      hostname: 'gpu-a',
      instances: ['127.0.0.2:41000'],
      state: 'down',
      as_of_s: 1717999990,
      scrape_interval_s: 1,
      note: 'exporter down (up == 0)',
      devices: []
    },
    {
      hostname: 'gpu-b',
      instances: ['127.0.0.3:41001'],
      state: 'ok',
      as_of_s: 1718000009.6,
      scrape_interval_s: 1,
      note: null,
      devices: [
        {
          uuid: 'GPU-bbbb0002',
          index: 2,
          mig_index: null,
          label: 'GPU 2',
          name: 'NVIDIA L4',
          available: true,
          source: 'autogpu',
          utilization_pct: 30,
          memory_used_bytes: 2 * GiB,
          memory_total_bytes: 24 * GiB,
          memory_free_bytes: 22 * GiB,
          memory_booked_bytes: 4 * GiB,
          temperature_c: 46,
          power_w: 30,
          lease_count: 1,
          waiters: 0,
          holders: ['alice', '<img src=x onerror=alert(1)>']
        },
        {
          uuid: 'GPU-bbbb0003',
          index: 3,
          mig_index: null,
          label: 'GPU 3',
          name: 'NVIDIA L4',
          available: false,
          source: 'autogpu',
          utilization_pct: null,
          memory_used_bytes: null,
          memory_total_bytes: null,
          memory_free_bytes: null,
          memory_booked_bytes: 0,
          temperature_c: null,
          power_w: null,
          lease_count: 0,
          waiters: 0,
          holders: []
        }
      ]
    }
  ],
  ranking: [
    {
      hostname: 'gpu-b',
      fits: true,
      chosen: [
        { uuid: 'GPU-bbbb0002', label: 'GPU 2', effective_free_bytes: 1 }
      ]
    },
    {
      hostname: 'dgx-d',
      fits: true,
      chosen: [{ uuid: 'GPU-dddd0001/1', label: 'GPU 1 MIG 1' }]
    },
    { hostname: 'gpu-a', fits: false, chosen: [] }
  ]
};

describe('clusterView', () => {
  it('orders hosts as the server ranked them and words each line', () => {
    const view = clusterView(parseCluster(answer), 1718000010);
    expect(view.visible).toBe(true);
    expect(view.source).toBe('from http://127.0.0.1:9090');
    expect(view.advice).toBe('best host for min free 10.0 GiB: gpu-b (GPU 2)');
    expect(view.hosts.map(h => [h.hostname, h.badge, h.best])).toEqual([
      ['gpu-b', '', true],
      ['dgx-d', '', false],
      ['gpu-a', 'down', false]
    ]);
    expect(view.hosts[0].asOf).toMatch(/^as of \d\d:\d\d:\d\d \(0 s ago\)$/);
    expect(view.hosts[2].asOf).toMatch(/^as of \d\d:\d\d:\d\d \(20 s ago\)$/);
    expect(view.hosts[2].note).toBe('exporter down (up == 0)');
    expect(view.hosts[2].gpus).toEqual([]);
    expect(view.hosts[0].gpus).toEqual([
      {
        label: 'GPU 2',
        name: 'NVIDIA L4',
        util: '30%',
        memory: '2.0 GiB / 24.0 GiB + 4.0 GiB booked',
        // text, shown with textContent: markup stays text
        holders: 'alice, <img src=x onerror=alert(1)>',
        source: null,
        lost: false
      },
      {
        label: 'GPU 3',
        name: 'NVIDIA L4',
        util: 'lost',
        memory: '',
        holders: '',
        source: null,
        lost: true
      }
    ]);
    expect(view.hosts[1].gpus[0]).toEqual({
      label: 'GPU 1 MIG 1',
      name: 'NVIDIA A100-SXM4-80GB',
      util: '50%',
      memory: '1000.0 MiB / 39.1 GiB',
      holders: '',
      source: 'dcgm',
      lost: false
    });
  });

  it('stays hidden without a Prometheus, and says when nothing fits', () => {
    const off = parseCluster({ configured: false, hosts: [], errors: [] });
    expect(clusterView(off, 0)).toEqual({
      visible: false,
      source: '',
      advice: '',
      errors: [],
      hosts: []
    });
    const none = parseCluster({ ...answer, best: null });
    expect(clusterView(none, 1718000010).advice).toBe(
      'no host has a device for min free 10.0 GiB'
    );
    const unreachable = parseCluster({
      configured: true,
      prometheus_url: 'http://p:9090',
      hosts: [],
      ranking: [],
      best: null,
      errors: [
        'cannot reach Prometheus at http://p:9090: [Errno 111] Connection refused'
      ]
    });
    const view = clusterView(unreachable, 0);
    expect(view.advice).toBe('');
    expect(view.errors).toEqual([
      'cannot reach Prometheus at http://p:9090: [Errno 111] Connection refused'
    ]);
  });

  it('marks no host best when nothing fits, and only the best one otherwise', () => {
    // Issue 22: the "best" badge follows the server's `best`, never the first host's place
    // (caught: the badge put on the first host of the ranking even when nothing fits).
    const none = clusterView(
      parseCluster({
        ...answer,
        best: null,
        ranking: answer.ranking.map(r => ({ ...r, fits: false, chosen: [] }))
      }),
      1718000010
    );
    expect(none.hosts.map(h => [h.hostname, h.best])).toEqual([
      ['gpu-b', false],
      ['dgx-d', false],
      ['gpu-a', false]
    ]);
    const second = clusterView(
      parseCluster({ ...answer, best: 'dgx-d' }),
      1718000010
    );
    expect(second.hosts.map(h => [h.hostname, h.best])).toEqual([
      ['gpu-b', false],
      ['dgx-d', true],
      ['gpu-a', false]
    ]);
  });

  it('rejects answers that are not a cluster answer', () => {
    expect(() => parseCluster({ hosts: [] })).toThrow(
      'unexpected cluster answer from the server: {"hosts":[]}'
    );
    expect(() =>
      parseCluster({ configured: true, hosts: [{ state: 'ok' }] })
    ).toThrow('unexpected cluster host');
  });

  it('words ages', () => {
    expect([
      ageText(-2),
      ageText(59.6),
      ageText(600),
      ageText(3 * 3600)
    ]).toEqual(['0 s ago', '60 s ago', '10 min ago', '3 h ago']);
  });
});

describe('cluster history', () => {
  const raw = {
    configured: true,
    prometheus_url: 'http://127.0.0.1:9090',
    seconds: 86400,
    step_s: 720,
    errors: [],
    hosts: [
      {
        hostname: 'gpu-b',
        source: 'autogpu',
        timestamps_s: [1, 2, 3, 4],
        utilization_pct: [null, 20, 36.6, 70],
        memory_used_pct: [null, 10, 10, 12]
      },
      {
        hostname: 'gpu-a',
        source: 'autogpu',
        timestamps_s: [1, 2, 3, 4],
        utilization_pct: [null, null, null, null],
        memory_used_pct: [null, null, null, null]
      }
    ]
  };

  it('summarises the known points of each host', () => {
    const history = parseClusterHistory(raw);
    expect(history.seconds).toBe(86400);
    expect(historySummary(history.hosts.get('gpu-b')!, 86400)).toBe(
      'last 24 h: util mean 42%, max 70%'
    );
    expect(historySummary(history.hosts.get('gpu-a')!, 86400)).toBe(
      'last 24 h: no data'
    );
    const view = clusterView(parseCluster(answer), 1718000010, history);
    const byName = new Map(view.hosts.map(h => [h.hostname, h.history]));
    expect(byName.get('gpu-b')).toEqual({
      label: 'last 24 h: util mean 42%, max 70%',
      values: [null, 20, 36.6, 70]
    });
    expect(byName.get('dgx-d')).toBeNull(); // no history for it in this answer
  });

  it('words windows and rejects what is not a history answer', () => {
    expect([
      windowText(86400),
      windowText(7 * 86400),
      windowText(5400),
      windowText(3600)
    ]).toEqual(['24 h', '7 d', '90 min', '1 h']);
    expect(() => parseClusterHistory({ hosts: [{ x: 1 }] })).toThrow(
      'unexpected cluster history host from the server: {"x":1}'
    );
  });
});

describe('translation', () => {
  const marked: ITrans = {
    __: (msgid: string, ...args: unknown[]) =>
      '«' + noTranslation.__(msgid, ...args) + '»',
    _n: (one: string, many: string, n: number, ...args: unknown[]) =>
      '«' + noTranslation._n(one, many, n, ...args) + '»'
  };

  it('puts the Cluster words through the bundle', () => {
    const view = clusterView(parseCluster(answer), 1718000010, null, marked);
    expect(view.source).toBe('«from http://127.0.0.1:9090»');
    expect(view.advice).toBe(
      '«best host for min free 10.0 GiB: gpu-b (GPU 2)»'
    );
    expect(view.hosts[0].asOf).toMatch(
      /^«as of \d\d:\d\d:\d\d \(«0 s ago»\)»$/
    );
    expect(ageText(600, marked)).toBe('«10 min ago»');
    expect(windowText(86400, marked)).toBe('«24 h»');
  });
});
