/**
 * The sidebar reads the wire as the server's schema states it. The answer types are the
 * generated ones (`../schema`, from autogpu_jupyter/server/schema.py by
 * scripts/wire_schema.py), re-exported by `../model`; these tests pin that the validators keep
 * every field the server sends, as sent. Each answer below is typed as the generated interface,
 * so a field added to the schema does not compile here until the answer (and the validator,
 * typed against the same interface) carries it. Values differ from the validators' defaults,
 * so a field a validator dropped or renamed shows as a difference.
 */
import {
  parseCluster,
  parseClusterHistory,
  type ICluster,
  type IClusterHistory
} from '../clustermodel';
import {
  parseDevice,
  parseFleet,
  parseHistory,
  parseHolders,
  parseMoveResult,
  parseSelection,
  type ISelection
} from '../model';
import type * as wire from '../schema';

const GiB = 1024 ** 3;

const device: wire.IDeviceJSON = {
  index: 1,
  uuid: 'GPU-1',
  name: 'AMD Instinct MI300X',
  pci_bus_id: '0000:41:00.0',
  memory_total_bytes: 80 * GiB,
  memory_used_bytes: 20 * GiB,
  memory_free_bytes: 60 * GiB,
  utilization_pct: 35,
  memory_utilization_pct: 12,
  temperature_c: 51,
  power_w: 210,
  power_limit_w: 400,
  compute_mode: 'Default',
  mig_enabled: true,
  is_mig: true,
  parent_uuid: 'GPU-0',
  mig_index: 2,
  processes: [
    { pid: 4242, used_memory_bytes: GiB, user: 'alice', command: 'python' }
  ],
  available: false,
  error: 'lost',
  vendor: 'amd',
  runtime_uuid: 'GPU-abcdef',
  timestamp_s: 12.5,
  label: 'GPU 1 MIG 2'
};

const holder: wire.IHolderJSON = {
  kind: 'lease+process',
  uuid: 'GPU-1',
  label: 'GPU 1',
  user: 'me',
  pid: 100,
  kernel_id: 'abcdef0123456789',
  this_server: true,
  notebook_path: 'work/train.ipynb',
  booked_bytes: 10 * GiB,
  used_memory_bytes: 3 * GiB,
  exclusive: true,
  created_s: 1,
  command: 'python -m ipykernel',
  where: 'work/train.ipynb',
  memory_text: '10.0 GiB booked, 3.0 GiB used, exclusive'
};

const kernel: wire.IKernelJSON = {
  kernel_id: 'abcdef0123456789',
  notebook_path: 'work/train.ipynb',
  execution_state: 'idle',
  idle_s: 700,
  movable: true,
  picked_uuids: ['GPU-1'],
  constraints_text: 'min free 10 GiB',
  note: 'a note',
  allowed_uuids: ['GPU-1', 'GPU-2'],
  overload: 'autogpu: GPU 1 (this kernel) is overloaded',
  better: { uuid: 'GPU-2', label: 'GPU 2' },
  waiting: true,
  best_move: { target: 'best', uuids: ['GPU-2'], labels: ['GPU 2'] },
  cull_warning: 'freed in 5 min'
};

describe('the validators keep every field of the wire, as sent', () => {
  it('devices', () => {
    expect(parseDevice(device)).toEqual(device);
    const fleet: wire.IDevicesAnswer = {
      timestamp_s: 9,
      backend: 'rocm',
      simulated: true,
      driver_version: '6.1',
      errors: ['e'],
      devices: [device],
      interval_s: 2
    };
    expect(parseFleet(fleet)).toEqual(fleet);
  });

  it('history', () => {
    const history: wire.IHistoryAnswer = {
      interval_s: 3,
      history_s: 600,
      since_s: 10,
      until_s: 13,
      series: [
        {
          uuid: 'GPU-1',
          timestamp_s: [11, 12],
          utilization_pct: [5, null],
          memory_used_bytes: [null, GiB],
          memory_total_bytes: 80 * GiB
        }
      ],
      errors: ['e']
    };
    expect(parseHistory(history)).toEqual(history);
  });

  it('holders and kernels', () => {
    const answer: wire.IHoldersAnswer = {
      timestamp_s: 9,
      simulated: true,
      user: 'me',
      holders: [holder],
      kernels: [kernel],
      errors: ['e']
    };
    expect(parseHolders(answer)).toEqual(answer);
  });

  it('select: the fields the recommendation reads', () => {
    const answer: wire.ISelectAnswer = {
      constraints: {
        min_free: { bytes: GiB, fraction: null, text: '1 GiB' },
        max_util_pct: null,
        count: 1,
        exclude: [],
        exclusive: false,
        models: [],
        prefer: [],
        devices: []
      },
      constraints_text: 'min free 1 GiB',
      simulated: true,
      timestamp_s: 9,
      notes: [],
      chosen: [{ uuid: 'GPU-2', label: 'GPU 2', name: 'NVIDIA L4' }],
      candidates: [],
      message: 'why',
      allocation: 'CUDA_VISIBLE_DEVICES=GPU-2'
    };
    const read: ISelection = {
      chosen: answer.chosen,
      constraints_text: answer.constraints_text,
      message: answer.message,
      simulated: answer.simulated
    };
    expect(parseSelection(answer)).toEqual(read);
  });

  it('move', () => {
    const answer: wire.IMoveAnswer = {
      dry_run: true,
      pending: true,
      plan: 'restart on GPU 2',
      target: ['GPU-2'],
      target_labels: ['GPU 2'],
      message: 'the kernel restarts on GPU 2',
      picked: ['GPU-2'],
      note: 'a note'
    };
    expect(parseMoveResult(answer)).toEqual(answer);
  });

  it('cluster: the fields the section reads, the ranking by label', () => {
    const gpu: wire.IClusterDeviceJSON = {
      uuid: 'GPU-9',
      index: 0,
      mig_index: null,
      label: 'GPU 0',
      name: 'NVIDIA H100',
      available: false,
      source: 'dcgm',
      utilization_pct: 70,
      memory_used_bytes: GiB,
      memory_total_bytes: 80 * GiB,
      memory_free_bytes: 79 * GiB,
      memory_booked_bytes: 2 * GiB,
      temperature_c: 40,
      power_w: 100,
      lease_count: 3,
      waiters: 1,
      holders: ['alice']
    };
    const answer: wire.IClusterAnswer = {
      configured: true,
      prometheus_url: 'http://prom:9090',
      timestamp_s: 9,
      constraints: {
        min_free: null,
        max_util_pct: null,
        count: 1,
        exclude: [],
        exclusive: false,
        models: [],
        prefer: [],
        devices: []
      },
      constraints_text: 'no constraints',
      hosts: [
        {
          hostname: 'node1',
          instances: ['node1:9400'],
          state: 'stale',
          as_of_s: 8,
          scrape_interval_s: 15,
          note: 'a note',
          devices: [gpu]
        }
      ],
      ranking: [
        {
          hostname: 'node1',
          fits: true,
          chosen: [{ uuid: 'GPU-9', label: 'GPU 0', effective_free_bytes: GiB }]
        }
      ],
      best: 'node1',
      errors: ['e']
    };
    const read: ICluster = {
      configured: true,
      prometheus_url: 'http://prom:9090',
      timestamp_s: 9,
      constraints_text: 'no constraints',
      hosts: [
        {
          hostname: 'node1',
          state: 'stale',
          as_of_s: 8,
          note: 'a note',
          devices: [
            {
              uuid: 'GPU-9',
              label: 'GPU 0',
              name: 'NVIDIA H100',
              available: false,
              source: 'dcgm',
              utilization_pct: 70,
              memory_used_bytes: GiB,
              memory_total_bytes: 80 * GiB,
              memory_booked_bytes: 2 * GiB,
              lease_count: 3,
              holders: ['alice']
            }
          ]
        }
      ],
      ranking: [{ hostname: 'node1', fits: true, chosen: ['GPU 0'] }],
      best: 'node1',
      errors: ['e']
    };
    expect(parseCluster(answer)).toEqual(read);

    const history: wire.IClusterHistoryAnswer = {
      configured: true,
      prometheus_url: 'http://prom:9090',
      seconds: 86400,
      step_s: 60,
      hosts: [
        {
          hostname: 'node1',
          source: 'dcgm',
          timestamps_s: [1, 2],
          utilization_pct: [10, null],
          memory_used_pct: [null, 50]
        }
      ],
      errors: []
    };
    const readHistory: IClusterHistory = {
      seconds: 86400,
      hosts: new Map([
        [
          'node1',
          {
            hostname: 'node1',
            utilization_pct: [10, null],
            memory_used_pct: [null, 50]
          }
        ]
      ])
    };
    expect(parseClusterHistory(history)).toEqual(readHistory);
  });
});
